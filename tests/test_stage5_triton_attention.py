"""Stage 5: the Triton kernels, checked against stage 4's reference.

Without CUDA the kernels run in Triton's interpreter, in float32 (the module sets
TRITON_INTERPRET=1 before importing Triton). Cases marked ``gpu`` run on a CUDA device. Where
Triton cannot be imported (it is built for Linux on x86-64 only), every test is collected and
skipped, for want of Triton: the grader holds their points back.
"""

import os
import subprocess
import sys
from pathlib import Path

import helpers_tolerances as tolerances
import pytest
import torch
from helpers_attention import before_the_window_as_nan, make_paged_inputs

from minipaged.stage4_reference_attention import paged_attention_ref

try:
    import triton
except ImportError:
    triton = None

if triton is not None:
    from minipaged.stage5_triton_attention import PARTITION_SIZE, paged_attention_triton
else:  # every test is skipped: the cases are only listed
    PARTITION_SIZE, paged_attention_triton = 512, None

pytestmark = [pytest.mark.stage5,
              pytest.mark.skipif(triton is None, reason="needs Triton, which cannot be imported here")]

CASES = [  # heads, kv_heads, head_dim, block_size, seq_lens
    (8, 8, 64, 16, [1, 16, 17, 300]),
    (14, 2, 64, 16, [5, 700, 1200]),  # Qwen2.5-0.5B's 7:1 grouping; more than two partitions
    (32, 8, 128, 16, [33, PARTITION_SIZE, PARTITION_SIZE + 1]),
    (4, 1, 80, 3, [1, 2, 3, 100]),
    (8, 2, 96, 1, [1, 40, 77]),
    (6, 3, 112, 32, [31, 32, 33, 600]),
    (4, 4, 256, 5, [9, 130]),
    (12, 4, 128, 7, [1000]),
]
IDS = [f"h{c[0]}kv{c[1]}d{c[2]}b{c[3]}" for c in CASES]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decode_kernels_equal_the_reference(case, version):
    heads, kv_heads, head_dim, block_size, seq_lens = case
    args, _ = make_paged_inputs(heads, kv_heads, head_dim, block_size, seq_lens, seed=head_dim + block_size)
    expected = paged_attention_ref(*args[:5])
    out = paged_attention_triton(*args[:5], version=version)
    torch.testing.assert_close(out, expected, **tolerances.paged_attention(args))


@pytest.mark.parametrize("seq_lens", [[5, 13, 1], [600, 3]], ids=["one-partition", "two-partitions"])
def test_auto_chooses_by_vllms_rule_and_reads_nothing_back_given_the_lengths(seq_lens, monkeypatch):
    """vLLM's use_v1: v1 when one partition covers the longest sequence or the batch gives more than 512
    (sequence, head) pairs, up to 8k tokens; else v2. Given max_seq_len and no validation, nothing is
    read back from the device."""
    from helpers_device import count_host_syncs

    from minipaged import stage5_triton_attention as s5

    assert s5.use_v1(1, 32, 512) and not s5.use_v1(1, 32, 513)  # one partition of 512 tokens, or two
    assert s5.use_v1(17, 32, 4096) and not s5.use_v1(16, 32, 4096)  # 544 > 512 pairs; 512 is not more
    assert not s5.use_v1(256, 32, 8193) and s5.use_v1(256, 32, 8192)  # beyond 8k tokens: v2, whatever the batch
    args, _ = make_paged_inputs(4, 2, 16, 16, seq_lens, seed=5)
    chosen = []
    for name in ("_decode_v1_kernel", "_decode_v2_partial_kernel"):
        kernel = getattr(s5, name)
        monkeypatch.setattr(s5, name, type("Seen", (), {"__getitem__": lambda self, grid, n=name, k=kernel: (
            chosen.append(n), k[grid])[1]})())
    with count_host_syncs() as count:
        out = paged_attention_triton(*args[:5], validate=False, max_seq_len=max(seq_lens))
    assert count.total == 0, dict(count.calls)
    v1 = s5.use_v1(len(seq_lens), 4, max(seq_lens))
    assert chosen == ["_decode_v1_kernel" if v1 else "_decode_v2_partial_kernel"]
    torch.testing.assert_close(out, paged_attention_ref(*args[:5]), **tolerances.paged_attention(args))


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,seq_lens,query_lens",
    [(8, 2, 64, 16, [40, 90], [40, 30]),
     (14, 2, 64, 3, [70, 5, 20], [1, 5, 0]),
     (4, 1, 80, 16, [33, 64], [33, 17]),
     (4, 4, 256, 32, [50], [50])],
    ids=["prefill+chunk", "decode+empty", "d80", "d256"],
)
def test_prefill_kernel_equals_the_reference(heads, kv_heads, head_dim, block_size, seq_lens, query_lens):
    args, _ = make_paged_inputs(heads, kv_heads, head_dim, block_size, seq_lens, query_lens, seed=5)
    expected = paged_attention_ref(*args[:5], query_start_loc=args[5])
    out = paged_attention_triton(*args[:5], query_start_loc=args[5])
    torch.testing.assert_close(out, expected, **tolerances.paged_attention(args))


@pytest.mark.parametrize("version", ["v1", "v2", "prefill"])
@pytest.mark.parametrize("window", [1, 40, 600])
def test_kernels_with_a_sliding_window_equal_the_reference_and_skip_the_blocks_before_it(window, version):
    """Each kernel starts its loop at the window's first token: a block before it is never read."""
    if version == "prefill":
        seq_lens, query_lens = [40, 700, 70, 20], [40, 100, 1, 5]
    else:
        seq_lens, query_lens = [1, 17, 300, PARTITION_SIZE + 77, 1200], None
    args, _ = make_paged_inputs(8, 2, 64, 16, seq_lens, query_lens, seed=window)
    poisoned = before_the_window_as_nan(args, window, query_lens)
    expected = paged_attention_ref(*args[:5], query_start_loc=args[5], sliding_window=window)
    kwargs = {} if version == "prefill" else {"version": version}
    out = paged_attention_triton(*poisoned[:5], query_start_loc=poisoned[5], sliding_window=window, **kwargs)
    torch.testing.assert_close(out, expected, **tolerances.paged_attention(args))


def _padded_with_nan(t, width=128):
    """The same values, in rows of ``width`` whose memory past ``head_dim`` holds NaN."""
    wide = torch.full((*t.shape[:-1], width), float("nan"), dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_kernels_read_no_element_past_head_dim(head_dim):
    """A head_dim that is not a power of two is padded to D_PAD inside the kernels, and the
    memory past head_dim is not the head's: NaN there must not reach the output (every load
    of a row is masked by ``offs_d < HEAD_DIM``)."""
    heads, kv_heads, block_size = 4, 2, 4
    for query_lens in (None, [6, 3]):
        args, _ = make_paged_inputs(heads, kv_heads, head_dim, block_size, [6, 9], query_lens, seed=head_dim)
        query, key_cache, value_cache = (_padded_with_nan(t) for t in args[:3])
        assert key_cache.stride(2) == 128 and torch.isnan(key_cache.as_strided((1,), (1,), head_dim)).all()
        expected = paged_attention_ref(*args[:5], query_start_loc=args[5])
        for version in ("v1", "v2") if query_lens is None else ("v2",):
            out = paged_attention_triton(query, key_cache, value_cache, *args[3:5], query_start_loc=args[5],
                                         version=version)
            torch.testing.assert_close(out, expected, **tolerances.paged_attention(args))


def test_same_checks_as_the_reference_and_a_known_version():
    args, _ = make_paged_inputs(4, 2, 64, 16, [20, 35])
    torch.testing.assert_close(paged_attention_triton(*args[:5], version="v1"), paged_attention_ref(*args[:5]),
                               **tolerances.paged_attention(args))
    with pytest.raises(ValueError, match=r"^version\b"):
        paged_attention_triton(*args[:5], version="v3")
    with pytest.raises(ValueError, match=r"^seq_lens\b"):
        paged_attention_triton(*args[:4], args[4] + 100)


@pytest.mark.parametrize("version", ["v1", "v2", "prefill"])
def test_a_cache_stored_narrower_than_the_query_is_widened_tile_by_tile(version):
    """K/V kept in float16 under float32 queries: each tile is converted to the query's dtype after it is
    loaded, so the kernels compute on exactly the stored values (the caller skips the dtype check)."""
    query_lens = [3, 1, 5] if version == "prefill" else None
    args, _ = make_paged_inputs(4, 2, 64, 16, [40, 7, 600], query_lens, seed=3)
    query, key_cache, value_cache, tables, lens, starts = args
    narrow = key_cache.half(), value_cache.half()
    expected = paged_attention_ref(query, narrow[0].float(), narrow[1].float(), tables, lens, query_start_loc=starts)
    kwargs = {} if version == "prefill" else {"version": version}
    out = paged_attention_triton(query, *narrow, tables, lens, query_start_loc=starts, validate=False, **kwargs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **tolerances.attention(query, narrow[0].float(), narrow[1].float(), 600))


COMPILE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import minipaged.stage5_triton_attention as s5

dtype, arch = sys.argv[1], int(sys.argv[2])
types = {n: "*" + dtype for n in ("out", "query", "key_cache", "value_cache")}
types.update(block_tables="*i32", seq_lens="*i32", query_start_loc="*i32", scale="fp32",
             tmp_acc="*fp32", tmp_m="*fp32", tmp_l="*fp32")
common = dict(GROUP=4, HEAD_DIM=128, D_PAD=128, PRECISION="ieee" if dtype == "fp32" else "tf32",
              GROUP_PAD=16, BLOCK_N=64, BLOCK_M=32, PARTITION=512, PARTS_PAD=16)
for fn in (s5._decode_v1_kernel, s5._decode_v2_partial_kernel, s5._decode_v2_reduce_kernel, s5._prefill_kernel):
    names = fn.arg_names
    consts = {k: v for k, v in common.items() if k in names}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(source, target=GPUTarget("cuda", arch, 32))
    print("compiled", fn.fn.__name__)
"""


@pytest.mark.rounding_free
@pytest.mark.parametrize("dtype,arch", [("fp16", 80), ("bf16", 90)])
def test_kernels_compile_for_nvidia_gpus_without_one(dtype, arch, tmp_path):
    """Triton ships ptxas: compile every kernel to machine code for sm_80 / sm_90 offline, and
    none of them is a stub (a stub compiles, printing its hint, and computes nothing)."""
    import triton

    if not list(Path(triton.__file__).parent.glob("backends/nvidia/bin/ptxas")):
        pytest.skip("this Triton build ships no ptxas")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_DEFAULT_FP_FUSION": "1",
           "TRITON_CACHE_DIR": str(tmp_path)}  # compiled afresh: a cached stub would print nothing
    done = subprocess.run([sys.executable, "-c", COMPILE, dtype, str(arch)], capture_output=True,
                          text=True, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 4
    # a stub compiles too, and prints its hint as it does: no line but ours may appear
    assert [line for line in done.stdout.splitlines() if not line.startswith("compiled")] == []


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("version", ["v1", "v2", "prefill"])
def test_on_the_gpu_in_half_precision(dtype, version):
    query_lens = [30, 1, 200] if version == "prefill" else None
    args, _ = make_paged_inputs(32, 8, 128, 16, [30, 4000, 700], query_lens, dtype=dtype, device="cuda", seed=9)
    wide = [t.float() if t is not None and t.is_floating_point() else t for t in args]  # the same values
    expected = paged_attention_ref(*wide[:5], query_start_loc=wide[5])
    out = paged_attention_triton(*args[:5], query_start_loc=args[5], version="v2" if version == "prefill" else version)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tolerances.paged_attention(args))
