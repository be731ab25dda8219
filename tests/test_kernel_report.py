"""Stage 5's kernels compiled for A100 (sm_80) and H100 (sm_90) on this CPU: no spills,
vectorised K/V loads, and the report's readings checked against what they claim."""

import ast

import pytest

from minipaged.perf import kernel_report as kr

pytestmark = pytest.mark.tooling

KERNELS = {"_decode_v1_kernel", "_decode_v2_partial_kernel", "_decode_v2_reduce_kernel", "_prefill_kernel"}
TILE_LOADERS = KERNELS - {"_decode_v2_reduce_kernel"}  # the kernels that read K/V through the blocks


@pytest.fixture(scope="module")
def rows():
    return kr.report(targets=("sm_80", "sm_90"), dtypes=("bf16",), head_dims=(128, 80), groups=(8,),
                     block_sizes=(16,), processes=2)


@pytest.fixture(scope="module")
def rows_without_divisibility():
    return kr.report(divisibility=False, targets=("sm_90",), dtypes=("bf16",), head_dims=(128,), groups=(8,),
                     block_sizes=(16,), processes=2)


def test_every_kernel_compiles_for_both_targets(rows):
    assert {(r.kernel, r.target) for r in rows} == {(k, t) for k in KERNELS for t in ("sm_80", "sm_90")}
    assert all(0 < r.registers <= 255 for r in rows)


def test_no_kernel_spills(rows):
    assert [kr.format_row(r) for r in rows if r.spill_bytes] == []


def test_kv_tiles_arrive_by_cp_async_or_128_bit_loads(rows):
    for r in rows:
        if r.kernel in TILE_LOADERS:
            assert r.cp_async > 0 or r.vector_loads > 0, kr.format_row(r)
            assert r.scalar_16bit_loads == 0, kr.format_row(r)


def test_every_kernel_fits_two_programs_per_sm(rows):
    assert all(r.fits for r in rows), [kr.format_row(r) for r in rows if not r.fits]


def test_without_divisibility_the_tiles_are_loaded_element_by_element(rows, rows_without_divisibility):
    """The lesson the report exists for: the JIT's multiple-of-16 knowledge is what vectorises."""
    with_div = {r.kernel: r for r in rows if r.target == "sm_90" and r.head_dim == 128}
    for r in rows_without_divisibility:
        if r.kernel in TILE_LOADERS:
            assert r.cp_async == 0 and r.scalar_16bit_loads > 0, kr.format_row(r)
            assert r.registers >= with_div[r.kernel].registers


@pytest.mark.parametrize("head_dim, group, block_size", [(80, 7, 1), (128, 8, 16), (256, 1, 32)])
def test_launches_are_the_launchers_own(head_dim, group, block_size):
    launches = {launch.kernel: launch for launch in kr.launches(head_dim, group, block_size)}
    assert set(launches) == KERNELS
    d_pad = max(16, 1 << (head_dim - 1).bit_length())
    for name in KERNELS:
        consts = launches[name].constexprs
        assert consts["HEAD_DIM"] == head_dim and consts["D_PAD"] == d_pad
    v1 = launches["_decode_v1_kernel"]
    assert v1.constexprs["GROUP"] == group and v1.constexprs["GROUP_PAD"] >= 16
    assert v1.signature["key_cache"] == "*bf16" and v1.signature["block_tables"] == "*i32"
    assert {"key_cache", "value_cache", "s_kb", "s_ks", "s_kh"} <= set(v1.divisible)
    if block_size == 1:  # the JIT folds an integer equal to 1 into the kernel
        assert v1.constexprs["block_size"] == 1
    else:
        assert ("block_size" in v1.divisible) == (block_size % 16 == 0)


def test_programs_per_sm_counts_registers_and_shared_memory():
    assert kr.programs_per_sm(90, registers=128, shared=0) == 4  # 65,536 / (128 x 128 threads)
    assert kr.programs_per_sm(80, registers=32, shared=100 * 1024) == 1  # 163 KiB holds one
    assert kr.programs_per_sm(90, registers=32, shared=100 * 1024) == 2  # 227 KiB holds two


def _row(**changes):
    row = dict(kernel="_decode_v1_kernel", target="sm_90", dtype="bf16", head_dim=128, group=8, block_size=16,
               registers=120, spill_bytes=0, shared_bytes=38 * 1024, cp_async=35, vector_loads=2,
               scalar_16bit_loads=0, programs_per_sm=4)
    return kr.KernelReport(**(row | changes))


def test_the_command_fails_on_a_spill_or_a_compile_error(monkeypatch):
    lines = []
    monkeypatch.setattr(kr, "report", lambda **kw: [_row()])
    assert kr.main(["sm_90"], ["bf16"], print_fn=lines.append) == 0
    monkeypatch.setattr(kr, "report", lambda **kw: [_row(), _row(spill_bytes=8)])
    assert kr.main(["sm_90"], ["bf16"], print_fn=lines.append) == 1

    def broken(**kw):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(kr, "report", broken)
    assert kr.main(["sm_90"], ["bf16"], print_fn=lines.append) == 1
    with pytest.raises(ValueError):
        kr.main(["sm_75"], ["bf16"], print_fn=lines.append)


def test_decode_bytes_counts_kv_once_per_kv_head_plus_queries_outputs_and_tables():
    # batch 2, context 20, 4 query heads on 2 KV heads, head dim 8, block 16, 2-byte elements
    kv = 2 * 2 * 20 * 2 * 8 * 2  # K and V, every token, every KV head
    q_and_out = 2 * 2 * 4 * 8 * 2
    tables = 2 * 2 * 4 + 2 * 4  # two int32 block ids per sequence, one int32 length
    got = kr.decode_bytes(2, 20, num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, dtype_bytes=2)
    assert got == kv + q_and_out + tables


def test_the_bound_is_bytes_over_peak_bandwidth():
    shape = dict(batch=64, context=4096)
    assert kr.decode_bound_us("H200", **shape) == pytest.approx(kr.decode_bytes(**shape) / 4800e9 * 1e6)
    assert kr.decode_bound_us("A100-40GB", **shape) / kr.decode_bound_us("H200", **shape) == \
        pytest.approx(4800 / 1555)


def test_split_kv_gives_a_single_long_sequence_programs_for_every_sm():
    assert kr.decode_programs(1, 32768, version="v1") == 8  # 8 KV heads: 8 of 132 SMs busy
    assert kr.decode_programs(1, 32768, version="v2") == 8 * 64  # 64 partitions of 512 tokens
    assert kr.decode_programs(1, 32768, version="v2") / kr.GPUS["H100 SXM"][1] > 3


def test_padding_waste_of_group_and_head_dim():
    assert kr.padding_waste(8, 128) == (0.5, 0.0)  # 8 query heads in 16 rows
    assert kr.padding_waste(1, 128) == (15 / 16, 0.0)
    assert kr.padding_waste(7, 80) == (9 / 16, 0.375)  # head dim 80 in 128 lanes


def test_the_stage_page_states_the_computed_roofline():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "stages" / "5_triton_attention.md").read_text()
    shape = dict(batch=64, context=4096)
    assert f"**{kr.decode_bytes(**shape) / 1e6:,.0f} MB**" in page
    assert f"**{kr.decode_bound_us('H200', **shape):.0f} µs** on an H200" in page
    assert f"{kr.decode_bound_us('H100 SXM', **shape):.0f} µs on an H100 SXM" in page
    assert f"{kr.decode_bound_us('A100-40GB', **shape):.0f} µs on an A100-40GB" in page
    assert f"**{kr.decode_programs(1, 32768)}** programs" in page
    assert f"**{kr.decode_programs(1, 32768, version='v2')}** programs" in page
    group_pad, head_dim = 16, 128  # a group of 8 padded to 16 rows: two FLOPs per MAC, QK and PV
    flops_per_byte = (2 * 2 * group_pad * head_dim) / (2 * head_dim * 2)
    assert f"**{flops_per_byte:.0f}** FLOPs" in page
    assert f"{kr.padding_waste(7, 80)[1]:.1%} of the lanes" in page


def test_the_stubs_of_an_exercise_workspace_compile_for_a_gpu_and_print_their_hints(tmp_path):
    """A learner with a GPU gets the hint, not a compile error: the stubs compile (AOT, sm_90)."""
    import os
    import subprocess
    import sys

    from minipaged.learn.exercise import PACKAGE_DIR, make_workspace, solution_regions

    workspace = make_workspace(5, tmp_path / "ex5")
    code = ("from minipaged.perf import kernel_report as kr\n"
            "print('package', kr.__file__)\n"
            "for launch in kr.launches(128, 8, 16):\n"
            "    kr.compile_launch(launch, 90)\n"
            "    print('compiled', launch.kernel)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(workspace),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}  # a cached kernel is not compiled, and prints nothing
    done = subprocess.run([sys.executable, "-c", code], cwd=workspace, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"package {workspace.resolve()}" in done.stdout  # the workspace's code, not the reference's
    assert done.stdout.count("compiled") == 4
    source = (PACKAGE_DIR / "stage5_triton_attention.py").read_text()
    kernels = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in KERNELS]
    hints = [hint for begin, _, hint in solution_regions(source)
             if any(k.lineno <= begin <= k.end_lineno for k in kernels)]
    assert len(hints) == 4 and [h for h in hints if h not in done.stdout] == []  # printed while compiling


@pytest.mark.parametrize("language", ["", ".zh"])
def test_the_stage_5_pages_kernel_choice_table_is_use_v1s(language):
    """Every cell of the table 'Which decode kernel runs' (32 query heads) is what use_v1 chooses."""
    import re
    from pathlib import Path

    from minipaged.stage5_triton_attention import use_v1

    page = (Path(__file__).parent.parent / "docs" / "stages" / f"5_triton_attention{language}.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(v[12])` \| `(v[12])` \| `(v[12])` \| `(v[12])` \|$", page, re.M)
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256]
    for batch, *chosen in rows:
        assert chosen == ["v1" if use_v1(int(batch), 32, ctx) else "v2" for ctx in (1024, 4096, 16384, 32768)]


def test_the_fp8_variants_compile_for_sm90_without_spills_and_are_not_offered_to_sm80():
    """Stage 13's launches (an e4m3 cache, bf16 queries): Triton's fp8e4nv exists from sm_89 on."""
    rows = kr.report(targets=("sm_80", "sm_90"), dtypes=("fp8",), head_dims=(128, 64), groups=(1, 7),
                     block_sizes=(16,), processes=2)
    assert {(r.kernel, r.target) for r in rows} == {(k, "sm_90") for k in KERNELS}
    assert all(r.spill_bytes == 0 and 0 < r.registers <= 255 for r in rows)
    printed = []
    kr.main(["sm_80"], ["fp8"], quick=True, print_fn=printed.append)
    assert any(line.startswith("fp8 on sm_80: not compiled") for line in printed)
