"""Stage 4 — paged attention, the PyTorch reference: gather through the block table, attend.

Stages 1–3 decided *where* K/V live: in blocks scattered over the cache, found through
each sequence's block table. Attention must now read them from there. This stage does it
the plainest way: for each sequence, gather its blocks in logical order into contiguous
K/V (stage 2's ``gather_kv``, the one read path of the paged cache), then run stage 0's
``dense_attention``. Decode steps (one query per sequence) do the
same gather for the whole batch in one indexing operation, padded to the longest
sequence and masked, so that the engine does not loop over sequences in Python. It copies
every K/V it reads, so it is slower than a kernel, but obviously right: it is the
reference the Triton kernels of stage 5 are checked against.

The arguments are vLLM's:

* ``query`` — decode: ``(num_seqs, num_heads, head_dim)``, one new token per sequence.
  Variable length: ``(num_tokens, num_heads, head_dim)`` with ``query_start_loc``, int32
  ``(num_seqs + 1,)``: sequence ``i`` owns query rows ``query_start_loc[i] ..
  query_start_loc[i+1] - 1``, its *last* tokens (a prefill, or a chunk after a cached
  prefix), attending causally.
* ``key_cache``, ``value_cache`` — ``(num_blocks, block_size, num_kv_heads, head_dim)``.
* ``block_tables`` — int32 ``(num_seqs, max_blocks_per_seq)``; entries past a sequence's
  blocks are never read.
* ``seq_lens`` — int32 ``(num_seqs,)``: tokens of context, the new ones included (their
  K/V are already written into the cache).

``sliding_window`` — a layer that attends to a window (Mistral, Gemma, gpt-oss): a query at
position ``p`` reads keys ``max(0, p - sliding_window + 1) .. p`` only; the blocks before a
sequence's window are never read, so its table may name any block there.

``check_paged_attention_args`` is shared with stage 5: a wrong shape, dtype or device, a
``seq_len`` beyond what the block table holds, or a block id outside the cache is a
``ValueError`` naming the argument and what was expected.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from minipaged.stage0_contiguous import dense_attention
from minipaged.stage2_block_table import gather_kv

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(argument: str, expected: str, got: object) -> None:
    raise ValueError(f"{argument}: expected {expected}, got {got}")


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument if the inputs are inconsistent."""
    if key_cache.dim() != 4:
        _fail("key_cache", "4 dims (num_blocks, block_size, num_kv_heads, head_dim)", tuple(key_cache.shape))
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape:
        _fail("value_cache", f"the shape of key_cache {tuple(key_cache.shape)}", tuple(value_cache.shape))
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        _fail("query", f"(num_tokens, num_heads, {head_dim}) with num_heads a multiple of "
              f"num_kv_heads={num_kv_heads}", tuple(query.shape))
    if query.dtype not in DTYPES:
        _fail("query.dtype", f"one of {DTYPES}", query.dtype)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != query.dtype:
            _fail(f"{name}.dtype", f"{query.dtype}, the query's dtype", cache.dtype)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t is not None and t.device != query.device:
            _fail(f"{name}.device", f"the query's device {query.device}", t.device)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dtype != torch.int32 or num_seqs < 0:
        _fail("seq_lens", "int32 (num_seqs,)", f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"int32 ({num_seqs}, max_blocks_per_seq)",
              f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            _fail("query", f"one decode query per sequence ({num_seqs}, ...) without query_start_loc",
                  tuple(query.shape))
    elif query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        _fail("query_start_loc", f"int32 ({num_seqs + 1},)", f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    check_attention_metadata(block_tables.cpu().numpy(), seq_lens.cpu().numpy(),
                             None if query_start_loc is None else query_start_loc.cpu().numpy(),
                             num_tokens=query.shape[0], num_blocks=num_blocks, block_size=block_size)


def check_sliding_window(sliding_window: int | None) -> int | None:
    """``sliding_window`` itself, or ``ValueError`` when it is not a positive int (or None: no window)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        _fail("sliding_window", "a positive int, or None for none", sliding_window)
    return sliding_window


def check_attention_metadata(block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray | None, *,
                             num_tokens: int, num_blocks: int, block_size: int) -> None:
    """The checks that read the metadata's values, on host arrays: ``query_start_loc`` from 0 to
    ``num_tokens``, never decreasing; each ``seq_len`` at least 1, at least its number of queries, and
    within its table's width; the table entries in use in ``0 .. num_blocks - 1``.

    An engine runs them once per step on the host copies it builds; ``check_paged_attention_args``
    runs them on a call's tensors, which first copies them to the host: on a GPU, that waits for
    the device, so no engine does it in every layer."""
    if query_start_loc is None:
        query_lens = np.ones_like(seq_lens)
    else:
        query_lens = np.diff(query_start_loc)
        if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens or (query_lens < 0).any():
            _fail("query_start_loc", f"non-decreasing from 0 to num_tokens={num_tokens}", query_start_loc.tolist())
    if seq_lens.size and ((seq_lens < query_lens).any() or (seq_lens < 1).any()):
        _fail("seq_lens", "at least 1, and at least each sequence's number of queries", seq_lens.tolist())
    blocks_needed = (seq_lens.astype(np.int64) + block_size - 1) // block_size
    if seq_lens.size and blocks_needed.max() > block_tables.shape[1]:
        _fail("seq_lens", f"at most {block_tables.shape[1]} blocks x {block_size} tokens per sequence "
              "(the width of block_tables)", seq_lens.tolist())
    ids = block_tables[np.arange(block_tables.shape[1])[None, :] < blocks_needed[:, None]]
    if ids.size and ((ids < 0) | (ids >= num_blocks)).any():
        _fail("block_tables", f"block ids in 0 .. {num_blocks - 1} for the blocks in use",
              sorted(set(ids[(ids < 0) | (ids >= num_blocks)].tolist())))


def decode_attention_batched(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, max_seq_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode for a whole batch at once: gather every sequence, padded to the longest, and mask.

    query: ``(num_seqs, num_heads, head_dim)``, one query per sequence; returns the same shape.
    The same gather as ``gather_kv``, done for all sequences in one indexing operation;
    positions past a sequence's length are masked out, their K/V zeroed (a reused block may hold
    anything there, NaN too, which a mask alone would carry through: 0 * NaN), and the table
    entries past its blocks are never read (they may hold any value, even an id outside the
    cache). Query
    head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. ``scale`` defaults to
    ``1 / sqrt(head_dim)``. It equals stage 0's ``dense_attention`` on each sequence's K/V.
    ``max_seq_len``, the longest ``seq_len``, is the engine's host copy: without it, it is read
    from ``seq_lens``, which on a GPU waits for the device. With ``sliding_window``, only each
    sequence's last ``sliding_window`` positions are in use, and a block with none of them is never read.
    """
    # BEGIN SOLUTION gather (num_seqs, max_len, kv_heads, dim) through the tables, mask, attend
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    width = -(-max_len // block_size)
    positions = torch.arange(width * block_size, device=query.device)
    in_use = positions[None, :] < seq_lens[:, None]  # (num_seqs, width * block_size)
    if sliding_window is not None:  # and not before the window
        in_use &= positions[None, :] >= seq_lens[:, None] - sliding_window
    ids = block_tables[:, :width].long()
    ids = torch.where(in_use.view(num_seqs, width, block_size).any(-1), ids, 0)  # other entries: never trusted
    shape = (num_seqs, width * block_size, num_kv_heads, head_dim)
    inside = in_use.view(num_seqs, -1, 1, 1)  # slots past a sequence may hold anything, NaN too: zeroed, as vLLM
    keys = torch.where(inside, key_cache.index_select(0, ids.flatten()).view(shape), 0)  # key_cache[ids], faster
    values = torch.where(inside, value_cache.index_select(0, ids.flatten()).view(shape), 0)
    q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # a KV head's
    out = F.scaled_dot_product_attention(  # query heads attend as its rows: (seqs, kv_heads, group, dim)
        q, keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=in_use[:, None, None, :], scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
    # END SOLUTION


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    *,
    validate: bool = True,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over each sequence's K/V in the paged cache; shape of ``query``.

    Decode when ``query_start_loc`` is None (one query per sequence), variable length
    otherwise. ``scale`` defaults to ``1 / sqrt(head_dim)``. Sequences with one query go
    through ``decode_attention_batched`` together; longer ones, one by one, through
    ``gather_kv`` and ``dense_attention``. ``validate=False`` skips the checks of the
    arguments' values, which read them back from the device: an engine checks its step's metadata
    once on the host and passes ``max_seq_len`` (and ``max_query_len``, vLLM's names) from there.
    The sequences of a variable-length batch are walked on the host: this path reads
    ``query_start_loc`` and ``seq_lens`` back (stage 5's prefill kernel does not).
    """
    if validate:
        check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    window = dict(sliding_window=check_sliding_window(sliding_window))
    # BEGIN SOLUTION batch the one-query sequences; gather and attend causally for the others
    if query_start_loc is None:
        return decode_attention_batched(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                        **window)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    single = [i for i, n in enumerate(query_lens) if n == 1]
    if single:
        single_rows = torch.tensor([starts[i] for i in single], device=query.device)
        picked = torch.tensor(single, device=query.device)
        out[single_rows] = decode_attention_batched(query[single_rows], key_cache, value_cache, block_tables[picked],
                                                    seq_lens[picked], scale, max_seq_len, **window)
    block_size = key_cache.shape[1]
    for i, seq_len in enumerate(seq_lens.tolist()):
        if query_lens[i] > 1:
            first = 0 if sliding_window is None else max(0, seq_len - query_lens[i] - sliding_window + 1)
            skipped = first // block_size  # whole blocks before the first query's window: never read
            keys, values = gather_kv(key_cache, value_cache, block_tables[i, skipped:], seq_len - skipped * block_size)
            rows = slice(starts[i], starts[i + 1])
            out[rows] = dense_attention(query[rows], keys, values, scale=scale, causal=True, **window)
    return out
    # END SOLUTION
