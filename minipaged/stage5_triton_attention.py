"""Stage 5 — paged attention in Triton: read K/V straight from the blocks, in one pass.

Stage 4 copied every sequence's K/V into a contiguous tensor before attending. A kernel
reads each K/V row where it lies instead: token ``t`` of sequence ``s`` is in block
``block_tables[s, t // block_size]`` at offset ``t % block_size``. A program loads a tile
of ``BLOCK_N`` tokens chosen for the hardware, and each token of the tile looks up its own
block, so the tile is not tied to the page size: any ``block_size`` works.

A long context is consumed tile by tile with an **online softmax**: keep the running
maximum ``m``, the running sum ``l`` of ``exp(score - m)``, and the running weighted sum
``acc`` of values; when a tile raises the maximum, rescale ``l`` and ``acc`` by
``exp(m_old - m_new)``. At the end ``acc / l`` is exactly the softmax-weighted sum.

Each K or V tile is converted to the query's dtype as soon as it is loaded: a cache may store its
values in a narrower dtype than the query's, and the kernels then compute on exactly the stored
values, widened in registers (for the same dtype the conversion is nothing).

A head's ``head_dim`` values are padded to ``D_PAD``, a power of two, inside the kernels; every
load of a row (a query, a K or V tile) is masked by ``offs_d < HEAD_DIM``, since the memory past
``head_dim`` is not the head's: the next head's values, or a padded row's spare slots, which may
hold anything (NaN times a zero query is still NaN). A query or K load past ``head_dim`` reaches the
scores, and the tests catch it; a V tile's padded columns reach only the padded columns of ``acc``,
which the store leaves out, but unmasked they would read past the end of the cache's last row.

Three kernels, each checked against stage 4:

* ``v1`` (decode) — one program per (sequence, KV head). All the query heads that share
  the KV head (grouped-query attention) go through the context together, so each K/V row
  is read once.
* ``v2`` (decode, split-KV, as in flash-decoding) — the context is cut into partitions of
  ``PARTITION_SIZE`` tokens, handled by programs in parallel; each writes a partial
  ``(m, l, acc)``, and a reduce kernel merges them, weighting partition ``p`` by
  ``exp(m_p - max_p m_p)``. With few sequences and long contexts, v1 leaves most of a GPU
  idle; v2 does not.
* ``prefill`` (variable-length queries: a prompt, or a chunk after a cached prefix) — one
  program per (sequence, query head, tile of queries), causal, flash-attention style.

Without CUDA, the kernels run in Triton's interpreter: slowly, in float32, but the same
code. ``TRITON_INTERPRET=1`` must be set before Triton is first imported (Triton's own
helpers are compiled at import); this module sets it when it is the first to import Triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minipaged.stage4_reference_attention import check_paged_attention_args, check_sliding_window  # noqa: E402

PARTITION_SIZE = 512  # tokens of context per program in v2
WHOLE_CONTEXT = 2**30  # the window of a layer without one: longer than any context
VERSIONS = ("v1", "v2")  # the decode kernels; version="auto" chooses one by use_v1


def use_v1(num_seqs: int, num_heads: int, max_seq_len: int) -> bool:
    """vLLM's choice of decode kernel: v1 when one partition covers the longest sequence, or when the
    batch alone gives the GPU enough programs (``num_seqs * num_heads > 512``), up to 8k tokens of
    context; v2 otherwise, whose partitions keep the GPU busy with few, long sequences."""
    max_num_partitions = -(-max_seq_len // PARTITION_SIZE)
    return max_seq_len <= 8192 and (max_num_partitions == 1 or num_seqs * num_heads > 512)


@triton.jit
def _load_tile(cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM: tl.constexpr):
    # BEGIN SOLUTION each token of the tile finds its own block through the table row: (BLOCK_N, D_PAD)
    block = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
    rows = block * s_kb + (pos % block_size) * s_ks + kv_head * s_kh
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(cache + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    # END SOLUTION


@triton.jit
def _online_softmax(q, k, v, visible, m, l, acc, scale, PRECISION: tl.constexpr):
    # BEGIN SOLUTION scores of one tile; raise the running max, rescale l and acc, add the tile
    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache stored narrower than the query is widened in registers
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (rows, BLOCK_N)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)  # rescales what was accumulated under the old maximum
    p = tl.exp(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc
    # END SOLUTION


@triton.jit
def _decode_v1_kernel(
    out, query, key_cache, value_cache, block_tables, seq_lens, scale, window,
    s_qt, s_qh, s_ot, s_oh, s_kb, s_ks, s_kh, s_bt, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # BEGIN SOLUTION load the group's queries, loop over the context tile by tile, store acc / l
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g  # the query heads that read this KV head
    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table_row = block_tables + seq * s_bt
    for start in range(tl.maximum(seq_len - window, 0), seq_len, BLOCK_N):  # the window's first token on
        pos = start + tl.arange(0, BLOCK_N)  # token positions of this tile
        valid = pos < seq_len
        k = _load_tile(key_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        v = _load_tile(value_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        m, l, acc = _online_softmax(q, k, v, valid[None, :], m, l, acc, scale, PRECISION)
    result = acc / l[:, None]
    tl.store(out + seq * s_ot + heads[:, None] * s_oh + offs_d[None, :], result.to(out.dtype.element_ty), mask=q_mask)
    # END SOLUTION


@triton.jit
def _decode_v2_partial_kernel(
    tmp_acc, tmp_m, tmp_l, query, key_cache, value_cache, block_tables, seq_lens, scale, window,
    s_qt, s_qh, s_kb, s_ks, s_kh, s_bt, block_size, num_heads, max_parts,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, PRECISION: tl.constexpr,
):
    # BEGIN SOLUTION as v1, over one partition of the context; store the unnormalised (acc, m, l)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g
    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(query + seq * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    end = tl.minimum(part * PARTITION + PARTITION, seq_len)  # empty partitions skip the loop
    table_row = block_tables + seq * s_bt
    for start in range(tl.maximum(part * PARTITION, seq_len - window), end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_tile(key_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        v = _load_tile(value_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        m, l, acc = _online_softmax(q, k, v, valid[None, :], m, l, acc, scale, PRECISION)
    slot = (seq * num_heads + heads) * max_parts + part  # (GROUP_PAD,) index into (seqs, heads, parts)
    head_ok = offs_g < GROUP
    tl.store(tmp_m + slot, m, mask=head_ok)
    tl.store(tmp_l + slot, l, mask=head_ok)
    tl.store(tmp_acc + slot[:, None] * D_PAD + offs_d[None, :], acc, mask=head_ok[:, None])
    # END SOLUTION


@triton.jit
def _decode_v2_reduce_kernel(
    out, tmp_acc, tmp_m, tmp_l, seq_lens, s_ot, s_oh, num_heads, max_parts,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PARTS_PAD: tl.constexpr, PARTITION: tl.constexpr,
):
    # BEGIN SOLUTION merge the partitions: weights exp(m_p - max m), out = sum(w acc_p) / sum(w l_p)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, D_PAD)
    in_use = offs_p < tl.cdiv(seq_len, PARTITION)
    base = (seq * num_heads + head) * max_parts
    m = tl.load(tmp_m + base + offs_p, mask=in_use, other=float("-inf"))
    l = tl.load(tmp_l + base + offs_p, mask=in_use, other=0.0)
    acc = tl.load(tmp_acc + (base + offs_p)[:, None] * D_PAD + offs_d[None, :], mask=in_use[:, None], other=0.0)
    weight = tl.where(in_use, tl.exp(m - tl.max(m, 0)), 0.0)
    result = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * l, 0)
    tl.store(out + seq * s_ot + head * s_oh + offs_d, result.to(out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    # END SOLUTION


@triton.jit
def _prefill_kernel(
    out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
    s_qt, s_qh, s_ot, s_oh, s_kb, s_ks, s_kh, s_bt, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # BEGIN SOLUTION a tile of one sequence's queries; query i sees context + i - window + 1 .. context + i
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens before the first query (a cached prefix)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(query + (q_start + offs_m)[:, None] * s_qt + head * s_qh + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = context + offs_m  # absolute position of each query
    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # the first query's window starts at lo; each row's first visible key is in the first tile (BLOCK_M <= BLOCK_N)
    lo = tl.maximum(context + tile * BLOCK_M - window + 1, 0)
    hi = tl.where(tile * BLOCK_M < q_len, tl.minimum(seq_len, context + (tile + 1) * BLOCK_M), 0)
    table_row = block_tables + seq * s_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < seq_len
        k = _load_tile(key_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        v = _load_tile(value_cache, table_row, pos, valid, kv_head, offs_d, block_size, s_kb, s_ks, s_kh, HEAD_DIM)
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)  # causal, windowed
        visible = valid[None, :] & seen
        m, l, acc = _online_softmax(q, k, v, visible, m, l, acc, scale, PRECISION)
    result = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows past the last query have no keys
    o_ptrs = out + (q_start + offs_m)[:, None] * s_ot + head * s_oh + offs_d[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=q_mask)
    # END SOLUTION


def _common(query, key_cache, scale):
    """Compile-time constants shared by the kernels, the scale, and the cache strides."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[2]
    consts = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
                  PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                  BLOCK_N=64 if head_dim <= 128 else 32)  # tokens per tile: fits shared memory
    scale = head_dim**-0.5 if scale is None else float(scale)
    strides = (*key_cache.stride()[:3],)
    return consts, scale, strides


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    *,
    version: str = "auto",
    validate: bool = True,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Stage 4's ``paged_attention_ref``, computed by Triton kernels; same arguments, same result.

    Decode queries use kernel ``version``: ``"v1"``, ``"v2"``, or ``"auto"``, which chooses by
    ``use_v1``; variable-length queries (``query_start_loc`` given) use the prefill kernel.
    ``validate=False`` skips the checks of the arguments' values, which read ``seq_lens`` and
    ``block_tables`` back to the host. ``max_query_len`` and ``max_seq_len`` are the engine's host
    copies (vLLM's names): the grid needs the first, ``"auto"`` the second. Without them the first is
    read back from the device, and the second bounded by the block tables' width, so that given
    both, no call waits for the device. With ``sliding_window``, each kernel starts its loop at the
    window's first token: no tile before it is read, so its blocks may be gone from the tables.
    """
    if version not in (*VERSIONS, "auto"):
        raise ValueError(f"version: expected one of {(*VERSIONS, 'auto')}, got {version!r}")
    if validate:
        check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    if key_cache.stride(3) != 1 or value_cache.stride() != key_cache.stride():
        raise ValueError("key_cache and value_cache must be contiguous in head_dim and share strides")
    query = query if query.stride(2) == 1 else query.contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    consts, scale, (s_kb, s_ks, s_kh) = _common(query, key_cache, scale)
    window = check_sliding_window(sliding_window) or WHOLE_CONTEXT
    block_size, s_bt = key_cache.shape[1], block_tables.stride(0)
    qo_strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1))
    if query_start_loc is not None:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        grid = (num_seqs, num_heads, triton.cdiv(max_query_len, 32 if consts["HEAD_DIM"] <= 128 else 16))
        _prefill_kernel[grid](out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                              scale, window, *qo_strides, s_kb, s_ks, s_kh, s_bt, block_size,
                              BLOCK_M=32 if consts["HEAD_DIM"] <= 128 else 16, **consts)
        return out
    group = consts["GROUP"]
    group_pad = max(16, triton.next_power_of_2(group))
    num_kv_heads = key_cache.shape[2]
    if version == "auto":
        longest = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
        version = "v1" if use_v1(num_seqs, num_heads, longest) else "v2"
    if version == "v1":
        _decode_v1_kernel[(num_seqs, num_kv_heads)](
            out, query, key_cache, value_cache, block_tables, seq_lens, scale, window, *qo_strides,
            s_kb, s_ks, s_kh, s_bt, block_size, GROUP_PAD=group_pad, **consts)
        return out
    max_parts = triton.cdiv(block_tables.shape[1] * block_size, PARTITION_SIZE)
    d_pad = consts["D_PAD"]
    tmp_acc = torch.empty(num_seqs, num_heads, max_parts, d_pad, dtype=torch.float32, device=query.device)
    tmp_m = torch.empty(num_seqs, num_heads, max_parts, dtype=torch.float32, device=query.device)
    tmp_l = torch.empty_like(tmp_m)
    _decode_v2_partial_kernel[(num_seqs, num_kv_heads, max_parts)](
        tmp_acc, tmp_m, tmp_l, query, key_cache, value_cache, block_tables, seq_lens, scale, window,
        query.stride(0), query.stride(1), s_kb, s_ks, s_kh, s_bt, block_size, num_heads, max_parts,
        GROUP_PAD=group_pad, PARTITION=PARTITION_SIZE, **consts)
    _decode_v2_reduce_kernel[(num_seqs, num_heads)](
        out, tmp_acc, tmp_m, tmp_l, seq_lens, out.stride(0), out.stride(1), num_heads, max_parts,
        HEAD_DIM=consts["HEAD_DIM"], D_PAD=d_pad, PARTS_PAD=max(2, triton.next_power_of_2(max_parts)),
        PARTITION=PARTITION_SIZE)
    return out
