"""What the compiler made of stage 5's kernels, for GPUs this machine does not have.

Triton compiles ahead of time for a named target without a GPU: ``triton.compile`` turns a
kernel into PTX, and the ``ptxas`` that ships in Triton's wheel turns the PTX into a cubin
and reports, per kernel, the registers each thread uses and the bytes it spills to local
memory. That is what a kernel engineer reads before trusting a kernel:

* **spills** — a thread that needs more than 255 registers keeps the rest in local memory,
  which lives in DRAM: slow. A kernel here must not spill.
* **registers and shared memory** decide how many programs an SM holds at once (occupancy).
* **load width** — K/V tiles should arrive by ``cp.async`` (copied straight to shared
  memory, Ampere and later) or 128-bit vector loads. Triton can emit them only when it knows
  that pointers and strides are multiples of 16 elements: the JIT learns it from the
  arguments (``tt.divisibility``), so the report compiles with exactly what the launcher
  passes, specialised as the JIT would specialise it.

``launches(...)`` runs the real launcher, ``paged_attention_triton``, on small tensors with
its kernels replaced by recorders, so the constexprs and argument types are the ones the
launcher picks, never a copy. ``compile_kernel`` compiles one launch for one target and
reads ``ptxas -v``. Compiling needs Triton's compiler, not its interpreter: ``report`` runs
in fresh processes with ``TRITON_INTERPRET=0``; ``minipaged kernels`` prints it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TARGETS = {"sm_80": 80, "sm_90": 90}  # A100, H100/H200
# Per SM: registers, shared memory a block may use, resident threads (CUDA occupancy tables).
SM_LIMITS = {80: (65536, 163 * 1024, 2048), 90: (65536, 227 * 1024, 2048)}
DTYPES = ("bf16", "fp16", "fp8")  # fp8: bf16 queries over an e4m3 cache (stage 13)
FP8_MIN_ARCH = 89  # Triton's fp8e4nv (e4m3) needs Ada or Hopper: sm_80 has no such type
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 7, 8)  # query heads per KV head
BLOCK_SIZES = (1, 16, 32)
NUM_WARPS = 4  # the launcher keeps Triton's default
MIN_PROGRAMS_PER_SM = 2  # one program loads its next tile while another computes


@dataclass
class Launch:
    kernel: str  # the kernel's name in stage 5
    signature: dict  # argument name -> Triton type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict  # argument name -> value
    divisible: list  # names of the arguments known to be multiples of 16 (pointers: 16 bytes)


@dataclass
class KernelReport:
    kernel: str
    target: str
    dtype: str
    head_dim: int
    group: int
    block_size: int
    registers: int
    spill_bytes: int  # spill stores + loads, bytes per thread
    shared_bytes: int
    cp_async: int  # cp.async instructions in the PTX
    vector_loads: int  # 128-bit (v4 x 32-bit) global loads
    scalar_16bit_loads: int  # one 16-bit element per instruction: a tile not vectorised
    programs_per_sm: int  # resident programs per SM, from registers and shared memory

    @property
    def occupancy(self) -> float:
        """Resident warps per SM over the 64 an SM can hold."""
        return self.programs_per_sm * NUM_WARPS / 64

    @property
    def fits(self) -> bool:
        """No spill, and enough programs per SM to overlap loads with compute."""
        return self.spill_bytes == 0 and self.programs_per_sm >= MIN_PROGRAMS_PER_SM


def launches(head_dim: int, group: int, block_size: int, dtype: str = "bf16") -> list[Launch]:
    """The four kernel launches stage 5 makes for this shape (v1, v2's two, prefill); ``dtype="fp8"``: over
    an e4m3 cache, with bf16 queries, as stage 13 launches them."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from minipaged import stage5_triton_attention as s5

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[dtype]
    cache_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch_dtype  # fp8: bf16 queries, an e4m3 cache
    num_kv_heads, seq_len = 2, 2 * s5.PARTITION_SIZE + 1  # three partitions for v2
    blocks = -(-seq_len // block_size)
    key_cache = torch.zeros(blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    recorded: list[Launch] = []
    names = ("_decode_v1_kernel", "_decode_v2_partial_kernel", "_decode_v2_reduce_kernel", "_prefill_kernel")

    class Recorder:  # stands in for a kernel: ``kernel[grid](*args, **constexprs)`` records the call
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return self.record

        def record(self, *args, **kwargs):
            params = self.fn.arg_names
            signature, constexprs, divisible = {}, dict(kwargs), []
            for name, value in zip(params, args, strict=False):
                kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
                if kind == "constexpr":  # an integer equal to 1 is folded in, as the JIT does
                    constexprs[name] = spec
                else:
                    signature[name] = kind
                    if spec == "D":
                        divisible.append(name)
            signature.update({name: "constexpr" for name in constexprs})
            recorded.append(Launch(self.name, signature, constexprs, divisible))

    saved = {name: getattr(s5, name) for name in names}
    try:
        for name in names:
            setattr(s5, name, Recorder(name, saved[name]))
        query = torch.zeros(1, num_kv_heads * group, head_dim, dtype=torch_dtype)
        for version in s5.VERSIONS:
            s5.paged_attention_triton(query, key_cache, value_cache, tables, seq_lens, version=version, validate=False)
        chunk = torch.zeros(block_size + 1, num_kv_heads * group, head_dim, dtype=torch_dtype)
        starts = torch.tensor([0, chunk.shape[0]], dtype=torch.int32)
        s5.paged_attention_triton(chunk, key_cache, value_cache, tables, seq_lens, query_start_loc=starts,
                                  validate=False)
    finally:
        for name, fn in saved.items():
            setattr(s5, name, fn)
    return recorded


def ptxas_path(arch: int) -> Path:
    """The ``ptxas`` Triton itself uses for this architecture (its wheel ships two)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return Path(get_ptxas(arch).path)


def compile_launch(launch: Launch, arch: int, divisibility: bool = True):
    """``triton.compile`` for ``sm_<arch>``: the compiled kernel (PTX, cubin, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minipaged import stage5_triton_attention as s5

    fn = getattr(s5, launch.kernel)
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    attrs = {index[name]: [["tt.divisibility", 16]] for name in launch.divisible} if divisibility else {}
    source = ASTSource(fn=fn, signature=launch.signature, constexprs=launch.constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})


def read_ptxas(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill bytes per thread) as ``ptxas -v`` reports them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run([str(ptxas_path(arch)), "-v", f"--gpu-name={gpu}", str(path), "-o", str(path) + ".cubin"],
                              capture_output=True, text=True)
    info = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {info.strip()}")
    found = re.search(r"Used (\d+) registers", info)
    if found is None:
        raise RuntimeError(f"ptxas gave no register count for sm_{arch}: {info.strip()}")
    registers = int(found.group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    return registers, spills


def programs_per_sm(arch: int, registers: int, shared: int) -> int:
    """How many programs an SM holds at once, limited by registers, shared memory and threads."""
    regs_per_sm, shared_per_sm, threads_per_sm = SM_LIMITS[arch]
    threads = NUM_WARPS * 32
    by_regs = regs_per_sm // (max(registers, 1) * threads)
    by_shared = shared_per_sm // shared if shared else 32
    return min(by_regs, by_shared, threads_per_sm // threads, 32)


def compile_kernel(launch: Launch, target: str, dtype: str, shape: tuple[int, int, int],
                   divisibility: bool = True) -> KernelReport:
    arch = TARGETS[target]
    compiled = compile_launch(launch, arch, divisibility)
    ptx = compiled.asm["ptx"]
    registers, spills = read_ptxas(ptx, arch)
    shared = compiled.metadata.shared
    return KernelReport(
        launch.kernel, target, dtype, *shape, registers, spills, shared,
        cp_async=len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
        scalar_16bit_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx)),
        programs_per_sm=programs_per_sm(arch, registers, shared))


def jobs(targets=tuple(TARGETS), dtypes=DTYPES, head_dims=HEAD_DIMS, groups=GROUPS,
         block_sizes=BLOCK_SIZES) -> list[tuple]:
    """Every (launch, target, dtype, shape) of the table, launches found by the real launcher."""
    return [(launch, target, dtype, (head_dim, group, block_size))
            for dtype in dtypes for head_dim in head_dims for group in groups for block_size in block_sizes
            for launch in launches(head_dim, group, block_size, dtype) for target in targets
            if dtype != "fp8" or TARGETS[target] >= FP8_MIN_ARCH]


def _compile_all(todo: list[tuple], divisibility: bool) -> list[dict]:
    done: dict[str, KernelReport] = {}  # one compile per distinct launch: the shape only labels it
    rows = []
    for launch, target, dtype, shape in todo:
        key = repr((launch, target, dtype))
        if key not in done:
            done[key] = compile_kernel(launch, target, dtype, shape, divisibility)
        rows.append(asdict(done[key]) | dict(zip(("head_dim", "group", "block_size"), shape, strict=True)))
    return rows


def _worker() -> None:
    """A worker process: the table on stdin (JSON), its compiled rows on stdout (JSON)."""
    import json
    import sys

    args = json.loads(sys.stdin.read())
    table = {k: tuple(v) for k, v in args["table"].items()}
    json.dump(_compile_all(jobs(**table), args["divisibility"]), sys.stdout)


def report(divisibility: bool = True, processes: int | None = None, **table) -> list[KernelReport]:
    """Compile every kernel of the table (``jobs``' arguments) in fresh Python processes.

    Fresh, so that Triton starts in compiler mode whatever this process did (a notebook or a
    test runs the interpreter); the same ``minipaged`` as this one, so that in an exercise
    workspace it compiles the learner's kernels. The head dims are spread over ``processes``
    workers (the CPUs by default). ``divisibility=False`` compiles as if no argument were
    known to be a multiple of 16, to show what the specialisation buys.
    """
    import json
    import subprocess
    import sys

    full = dict(targets=tuple(TARGETS), dtypes=DTYPES, head_dims=HEAD_DIMS, groups=GROUPS,
                block_sizes=BLOCK_SIZES) | table
    head_dims = list(full["head_dims"])
    processes = max(1, min(processes or os.cpu_count() or 1, len(head_dims)))
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    workers = []
    for i in range(processes):
        part = dict(full, head_dims=head_dims[i::processes])
        worker = subprocess.Popen([sys.executable, "-c", "from minipaged.perf.kernel_report import _worker; _worker()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=package_root)
        workers.append((worker, json.dumps({"table": part, "divisibility": divisibility})))
    rows = []
    for worker, request in workers:
        out, err = worker.communicate(request)
        if worker.returncode:
            last = err.strip().splitlines()[-1] if err.strip() else worker.returncode
            raise RuntimeError(f"compiling failed: {last}")
        rows += [KernelReport(**row) for row in json.loads(out)]
    return rows


def format_row(r: KernelReport) -> str:
    loads = f"cp.async {r.cp_async:3d}, v4 {r.vector_loads:3d}, b16 {r.scalar_16bit_loads:3d}"
    return (f"{r.kernel:26s} {r.target} {r.dtype} d={r.head_dim:<3d} g={r.group} bs={r.block_size:<2d} "
            f"regs {r.registers:3d}  spill {r.spill_bytes:4d} B  smem {r.shared_bytes // 1024:3d} KiB  "
            f"{loads}  {r.programs_per_sm:2d}/SM{'' if r.fits else '  <-- below target'}")


def main(targets: list[str], dtypes: list[str], quick: bool = False, json_path: str | None = None,
         no_divisibility: bool = False, print_fn=print) -> int:
    """``minipaged kernels``: print the table; non-zero when a kernel fails to compile or spills."""
    import json

    unknown = [t for t in targets if t not in TARGETS] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown target or dtype {unknown}: targets {list(TARGETS)}, dtypes {list(DTYPES)}")
    table: dict[str, Any] = dict(head_dims=(80, 128), groups=(1, 8), block_sizes=(1, 16)) if quick else {}
    try:
        rows = report(divisibility=not no_divisibility, targets=tuple(targets), dtypes=tuple(dtypes), **table)
    except Exception as err:  # a kernel that does not compile for a target
        print_fn(f"compile failed: {type(err).__name__}: {str(err).strip().splitlines()[-1]}")
        return 1
    for row in rows:
        print_fn(format_row(row))
    for target in targets:
        if "fp8" in dtypes and TARGETS[target] < FP8_MIN_ARCH:
            print_fn(f"fp8 on {target}: not compiled, Triton's fp8e4nv needs sm_{FP8_MIN_ARCH} or later")
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    spilled = sorted({(r.kernel, r.target, r.dtype, r.head_dim) for r in rows if r.spill_bytes})
    distinct = len({(r.kernel, r.target, r.dtype, r.registers, r.shared_bytes) for r in rows})
    print_fn(f"{len(rows)} kernel launches compiled ({distinct} distinct) for {', '.join(targets)}: "
             f"{len(spilled)} spill, max {max((r.registers for r in rows), default=0)} registers")
    return 1 if spilled else 0


# The decode roofline: the least time a decode step's attention can take on a GPU.
# Decode reads every context token's K and V once per KV head and does little arithmetic
# with it, so its bound is the bytes it must move over the memory bandwidth.
GPUS = {  # peak HBM bandwidth (GB/s) and streaming multiprocessors, from the vendors' data sheets
    "A100-40GB": (1555, 108), "A100-80GB": (2039, 108), "H100 SXM": (3350, 132), "H200": (4800, 132)}


def decode_bytes(batch: int, context: int, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                 block_size: int = 16, dtype_bytes: int = 2) -> int:
    """Bytes one layer's decode attention must move: K/V of every context token once per KV
    head, the queries in, the outputs out, the block tables and sequence lengths."""
    kv = 2 * batch * context * num_kv_heads * head_dim * dtype_bytes
    queries_and_outputs = 2 * batch * num_heads * head_dim * dtype_bytes
    tables = batch * -(-context // block_size) * 4 + batch * 4  # int32 block ids and seq_lens
    return kv + queries_and_outputs + tables


def decode_bound_us(gpu: str, **shape) -> float:
    """The fastest one layer's decode attention could possibly run on ``gpu``: a bound, not a time."""
    return decode_bytes(**shape) / (GPUS[gpu][0] * 1e9) * 1e6


def decode_programs(batch: int, context: int, num_kv_heads: int = 8, version: str = "v1",
                    partition_size: int = 512) -> int:
    """Programs stage 5 launches for a decode step: one per (sequence, KV head) for v1, and
    one per (sequence, KV head, partition of the context) for v2's first kernel."""
    parts = 1 if version == "v1" else -(-context // partition_size)
    return batch * num_kv_heads * parts


def padding_waste(group: int, head_dim: int) -> tuple[float, float]:
    """Fractions of the query rows and head-dim lanes a program computes on and throws away:
    ``GROUP_PAD`` rounds the group up to 16 rows for ``tl.dot``, ``D_PAD`` the head dim up to
    a power of two. Masked lanes cost instructions and registers, not DRAM bytes."""
    group_pad = max(16, 1 << (group - 1).bit_length())
    d_pad = max(16, 1 << (head_dim - 1).bit_length())
    return 1 - group / group_pad, 1 - head_dim / d_pad
