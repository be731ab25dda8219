"""Stage 4: the PyTorch paged attention reference, checked against stage 0's dense attention."""

import helpers_tolerances as tolerances
import pytest
import torch
from helpers_attention import before_the_window_as_nan, make_paged_inputs, windowed_dense

from minipaged.stage0_contiguous import dense_attention
from minipaged.stage4_reference_attention import decode_attention_batched, paged_attention_ref

pytestmark = pytest.mark.stage4

HEADS = [(8, 8), (14, 2), (32, 8), (4, 1)]  # MHA, GQA (Qwen2.5-0.5B), GQA (Llama-3-8B), MQA
HEAD_DIMS = [64, 80, 96, 112, 128, 256]


def expected_outputs(args, contiguous, scale=None):
    query = args[0]
    out = torch.empty_like(query)
    for keys, values, rows in contiguous:
        if rows.start != rows.stop:
            out[rows] = dense_attention(query[rows], keys, values, scale=scale)
    return out


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa7", "gqa4", "mqa"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_equals_dense_attention_on_contiguous_kv(heads, head_dim):
    block_size = {64: 16, 80: 1, 96: 3, 112: 32, 128: 16, 256: 5}[head_dim]
    args, contiguous = make_paged_inputs(*heads, head_dim, block_size, [1, 17, 300, 2049], seed=head_dim)
    torch.testing.assert_close(paged_attention_ref(*args[:5]), expected_outputs(args, contiguous),
                               **tolerances.paged_attention(args))


@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 32, 64])
def test_any_block_size_and_contexts_up_to_thousands(block_size):
    lens = [1, block_size, block_size + 1, 1000, 4100]
    args, contiguous = make_paged_inputs(14, 2, 64, block_size, lens, seed=block_size)
    torch.testing.assert_close(paged_attention_ref(*args[:5], scale=0.1),
                               expected_outputs(args, contiguous, scale=0.1), **tolerances.paged_attention(args, 0.1))


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [([7, 40], [7, 40]),              # prefills
     ([100, 33, 9], [20, 1, 9]),      # a chunk after a cached prefix, a decode, a prefill
     ([50, 60], [0, 3]),              # a sequence with no query this step
     ([1], [1])],
    ids=["prefill", "mixed", "empty", "single"],
)
def test_variable_length_queries_are_causal_and_aligned_to_the_end(seq_lens, query_lens):
    args, contiguous = make_paged_inputs(8, 2, 64, 16, seq_lens, query_lens, seed=3)
    out = paged_attention_ref(*args[:5], query_start_loc=args[5])
    torch.testing.assert_close(out, expected_outputs(args, contiguous), **tolerances.paged_attention(args))
    # the last query of a sequence attends to the whole context, like a decode step
    first = contiguous[0][2]
    if first.stop > first.start:
        k, v, _ = contiguous[0]
        torch.testing.assert_close(out[first.stop - 1], dense_attention(args[0][first.stop - 1 : first.stop], k, v)[0],
                                   **tolerances.paged_attention(args))


@pytest.mark.parametrize("window", [1, 5, 16, 37, 5000])
@pytest.mark.parametrize("query_lens,seq_lens", [(None, [1, 16, 17, 300, 1200]),
                                                 ([40, 30, 1, 5, 0], [40, 90, 70, 20, 9])], ids=["decode", "varlen"])
def test_a_sliding_window_reads_only_the_blocks_it_sees(window, query_lens, seq_lens):
    """A query at position p attends to keys max(0, p - window + 1) .. p; a whole block before a
    sequence's window is never read (here: a block of NaN stands in for it)."""
    args, contiguous = make_paged_inputs(8, 2, 64, 16, seq_lens, query_lens, seed=window)
    poisoned = before_the_window_as_nan(args, window, query_lens)
    out = paged_attention_ref(*poisoned[:5], query_start_loc=poisoned[5], sliding_window=window)
    torch.testing.assert_close(out, windowed_dense(args[0], contiguous, window), **tolerances.paged_attention(args))
    for bad in (0, -3, 2.5, True, "8"):  # not a positive int
        with pytest.raises(ValueError):
            paged_attention_ref(*args[:5], query_start_loc=args[5], sliding_window=bad)


def widened(args, contiguous):
    """The same inputs in float32: the reference sees exactly the values the half-precision run reads."""
    wide = [t.float() if t is not None and t.is_floating_point() else t for t in args]
    return wide, [(k.float(), v.float(), rows) for k, v, rows in contiguous]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_close_to_a_float32_reference(dtype):
    args, contiguous = make_paged_inputs(32, 8, 128, 16, [3, 500, 1500], dtype=dtype, seed=7)
    out = paged_attention_ref(*args[:5])
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected_outputs(*widened(args, contiguous)),
                               **tolerances.paged_attention(args))


def _bad(args, **change):
    names = ["query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc"]
    values = dict(zip(names, args, strict=True))
    values.update(change)
    return [values[n] for n in names]


def _cases(args):
    q, kc, vc, bt, sl, _ = args
    return {
        "query head_dim": (_bad(args, query=q[..., :32]), r"^query\b"),
        "query heads": (_bad(args, query=q[:, :3]), r"^query\b"),
        "query rows": (_bad(args, query=q[:1]), r"^query\b"),
        "dtype": (_bad(args, query=q.half()), r"^key_cache\.dtype\b"),
        "integer dtype": (_bad(args, query=q.long(), key_cache=kc.long(), value_cache=vc.long()), r"^query\.dtype\b"),
        "value shape": (_bad(args, value_cache=vc[:, :8]), r"^value_cache\b"),
        "cache dims": (_bad(args, key_cache=kc[0]), r"^key_cache\b"),
        "seq_lens dtype": (_bad(args, seq_lens=sl.long()), r"^seq_lens\b"),
        "table dtype": (_bad(args, block_tables=bt.long()), r"^block_tables\b"),
        "seq_len too long": (_bad(args, seq_lens=sl + 64), r"^seq_lens\b"),
        "seq_len zero": (_bad(args, seq_lens=sl * 0), r"^seq_lens\b"),
        "block id": (_bad(args, block_tables=torch.where(bt == bt[0, 0], 999, bt).int()), r"^block_tables\b.*\[999\]"),
        "negative block id": (_bad(args, block_tables=torch.where(bt == bt[1, 0], -1, bt).int()),
                              r"^block_tables\b.*\[-1\]"),
        "query_start_loc": (_bad(args, query_start_loc=torch.tensor([0, 2, 1], dtype=torch.int32)),
                            r"^query_start_loc\b"),
        "query_start_loc dtype": (_bad(args, query_start_loc=torch.tensor([0, 1, 2])), r"^query_start_loc\b"),
        "device": (_bad(args, seq_lens=sl.to("meta")), r"^seq_lens\.device\b"),
    }


@pytest.mark.parametrize("case", list(_cases(make_paged_inputs(4, 2, 64, 16, [20, 35])[0])))
def test_bad_arguments_are_refused_naming_the_argument(case):
    args, contiguous = make_paged_inputs(4, 2, 64, 16, [20, 35], seed=1)
    torch.testing.assert_close(paged_attention_ref(*args[:5]), expected_outputs(args, contiguous),
                               **tolerances.paged_attention(args))
    bad, message = _cases(args)[case]
    with pytest.raises(ValueError, match=message):
        paged_attention_ref(*bad[:5], query_start_loc=bad[5])


def paged_case(lengths, heads=6, kv_heads=2, dim=16, block_size=4, seed=0):
    """K/V of several sequences scattered over a paged cache; unused table entries hold invalid ids."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lengths) + 2
    tables = torch.full((len(lengths), width), num_blocks + 7, dtype=torch.int32)  # never to be read
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[i, :used] = torch.tensor([order.pop() for _ in range(used)], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    contiguous = [tuple(c[tables[i, : -(-n // block_size)].long()].flatten(0, 1)[:n] for c in (key_cache, value_cache))
                  for i, n in enumerate(lengths)]
    return key_cache, value_cache, tables, seq_lens, contiguous


def test_batched_decode_alone_equals_dense_attention_and_never_reads_past_a_sequence():
    key_cache, value_cache, tables, seq_lens, kv = paged_case([5, 13, 1, 8])
    query = torch.randn(4, 6, 16)
    out = decode_attention_batched(query, key_cache, value_cache, tables, seq_lens)
    for i, (k, v) in enumerate(kv):
        torch.testing.assert_close(out[i : i + 1], dense_attention(query[i : i + 1], k, v),
                                   **tolerances.attention(query, key_cache, value_cache, int(seq_lens.max())))


@pytest.mark.parametrize("varlen", [False, True], ids=["decode", "varlen"])
def test_nan_left_in_a_reused_block_past_a_sequence_never_reaches_the_output(varlen):
    """A block reused after another sequence may hold anything past this one's end, NaN too."""
    lengths = [5, 13, 1, 7]
    key_cache, value_cache, tables, seq_lens, kv = paged_case(lengths)
    for i, n in enumerate(lengths):  # every slot past each sequence's end, in its last block
        last, used = int(tables[i, (n - 1) // 4]), n % 4
        if used:
            key_cache[last, used:] = float("nan")
            value_cache[last, used:] = float("nan")
    query = torch.randn(4, 6, 16)
    query_start_loc = torch.arange(5, dtype=torch.int32) if varlen else None
    out = paged_attention_ref(query, key_cache, value_cache, tables, seq_lens, query_start_loc=query_start_loc)
    assert torch.isfinite(out).all()
    clean = [(k.nan_to_num(), v.nan_to_num()) for k, v in kv]  # the slots in use hold no NaN
    for i, (k, v) in enumerate(clean):
        torch.testing.assert_close(out[i : i + 1], dense_attention(query[i : i + 1], k, v),
                                   **tolerances.attention(query, key_cache.nan_to_num(), value_cache.nan_to_num(),
                                                          int(seq_lens.max())))


@pytest.mark.parametrize("path", ["decode", "batched-decode", "varlen-single", "varlen-multi"])
def test_a_custom_scale_is_used_on_every_path(path):
    key_cache, value_cache, tables, seq_lens, kv = paged_case([6, 11, 9])
    scale = 0.37
    if path in ("decode", "batched-decode"):
        query = torch.randn(3, 6, 16)
        run = paged_attention_ref if path == "decode" else decode_attention_batched
        out = run(query, key_cache, value_cache, tables, seq_lens, scale)
        rows = [slice(i, i + 1) for i in range(3)]
    else:
        q_lens = [1, 1, 1] if path == "varlen-single" else [3, 1, 5]
        starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        query = torch.randn(starts[-1], 6, 16)
        out = paged_attention_ref(query, key_cache, value_cache, tables, seq_lens, scale,
                                  query_start_loc=torch.tensor(starts, dtype=torch.int32))
        rows = [slice(starts[i], starts[i + 1]) for i in range(3)]
    for i, (k, v) in enumerate(kv):
        want = dense_attention(query[rows[i]], k, v, scale=scale, causal=True)
        torch.testing.assert_close(out[rows[i]], want,
                                   **tolerances.attention(query, key_cache, value_cache, int(seq_lens.max()), scale))


def test_a_decode_given_its_longest_length_reads_nothing_back_and_the_metadata_is_checked_on_the_host():
    """Checked once per step, because each check waits for the device: with ``validate=False`` and
    ``max_seq_len`` (the engine's host copy), a decode reads no value back; ``check_attention_metadata``
    runs the value checks on host arrays, as the engine does once per step."""
    import numpy as np
    from helpers_device import count_host_syncs

    from minipaged.stage4_reference_attention import check_attention_metadata

    args, contiguous = make_paged_inputs(4, 2, 16, 4, [5, 13, 1, 8], seed=3)
    with count_host_syncs() as count:
        out = paged_attention_ref(*args[:5], validate=False, max_seq_len=13)
    assert count.total == 0, dict(count.calls)
    torch.testing.assert_close(out, expected_outputs(args, contiguous), **tolerances.paged_attention(args))
    tables, seq_lens = args[3].numpy(), args[4].numpy()
    num_blocks, block_size = args[1].shape[:2]
    check_attention_metadata(tables, seq_lens, None, num_tokens=4, num_blocks=num_blocks, block_size=block_size)
    bad = {"seq_len too long": (tables, seq_lens + 64, None), "seq_len zero": (tables, seq_lens * 0, None),
           "block id": (np.where(tables == tables[0, 0], 999, tables), seq_lens, None),
           "decreasing starts": (tables, seq_lens, np.array([0, 2, 1, 3, 4])),
           "starts past the tokens": (tables, seq_lens, np.array([0, 1, 2, 3, 5]))}
    for case, (t, s, starts) in bad.items():
        with pytest.raises(ValueError):
            check_attention_metadata(t, s, starts, num_tokens=4, num_blocks=num_blocks, block_size=block_size)
            pytest.fail(case)
