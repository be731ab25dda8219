"""The host's time per decode step, the model made nearly free: minipaged beside nano-vllm, in one process.

On a GPU the host must keep ahead of the device: schedule, apply the step's changes to the
batch, build the inputs and the attention metadata, start the copies, then turn the sampled
tokens into outputs. This measures that host path alone. The model is replaced by a stand-in
whose forward returns zeros and whose logits are rows of a fixed table (256 tokens wide, so
that the sampler's arithmetic is small beside its bookkeeping); everything else is the engine's
own: minipaged's default V1 engine, synchronous, greedy, every request asking for its output when
it finishes (as ``LLM.generate`` does). The time is the process's CPU time over the steady decode
steps of ``batch`` requests (prompts of 16 tokens, none finishing), at batch 1, 32, 128 and 256.

nano-vllm runs beside it, its steps interleaved with minipaged's, when it can be imported: from
``NANO_VLLM_PATH`` (a checkout of github.com/GeeeekExplorer/nano-vllm, MIT), or else an installed
``nanovllm`` (the package index has only ``nano-vllm-fork``, whose scheduler adds
classifier-free-guidance pairs and whose runner fills pinned buffers element by element: it is
labelled as what it is). Its host path is what its engine runs around the model:
``Scheduler.schedule``, ``ModelRunner.prepare_decode`` and ``prepare_sample``, the same stand-in's
argmax and ``Scheduler.postprocess``. On this CPU its ``.cuda()`` copies are no-ops and its pinned
buffers are ordinary ones. Each side keeps its own block size (16 and 256).

Writes bench/results/host_path.json and host_path.png (bench/results/quick/ with --quick); the
last line is the headline.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import types
from importlib import metadata
from pathlib import Path

import torch
from harness import environment, make_parser, results_dir_for, write_json

from minipaged import LLM, RequestOutputKind, SamplingParams

BATCHES = (1, 32, 128, 256)
PROMPT, VOCAB = 16, 256


class StandIn:
    """A near-free model: a forward of zeros, logits from a fixed table."""

    def __init__(self, rows: int, hidden: int = 8) -> None:
        self.table = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
        self.hidden = hidden

    def __call__(self, input_ids: torch.Tensor, *args) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table[: hidden.shape[0]]


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(PROMPT)] for _ in range(batch)]


class Minipaged:
    name = "minipaged"

    def __init__(self, batch: int, max_tokens: int) -> None:
        self.llm = LLM("tiny", max_num_seqs=batch, num_gpu_blocks=batch * (max_tokens // 16 + 4), max_model_len=
                       PROMPT + max_tokens + 16)
        self.llm.engine.runner.model = StandIn(batch)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for i, ids in enumerate(prompts(batch)):
            self.llm.engine.add_request(i, {"prompt_token_ids": ids}, params)
        while self.llm.stats.decode_tokens < 4 * batch:  # the prompts, then a few decodes
            self.llm.engine.step()

    def step(self) -> None:
        assert not self.llm.engine.step(), "not a steady decode step"


@contextlib.contextmanager
def cpu_shim():
    """nano-vllm's CUDA calls on this CPU: ``.cuda()`` returns the tensor, ``pin_memory=True`` is dropped."""
    cuda, tensor, zeros = torch.Tensor.cuda, torch.tensor, torch.zeros

    def unpinned(make):
        return lambda *args, pin_memory=False, **kwargs: make(*args, **kwargs)

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.tensor, torch.zeros = unpinned(tensor), unpinned(zeros)
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.tensor, torch.zeros = cuda, tensor, zeros  # type: ignore[method-assign]


def import_nano_vllm() -> tuple[types.ModuleType, str] | None:
    """nano-vllm's engine modules and what they are (a checkout, or the installed package), or None."""
    path = os.environ.get("NANO_VLLM_PATH")
    if path:
        sys.path.insert(0, path)
    sys.modules.setdefault("flash_attn", types.SimpleNamespace(  # type: ignore[arg-type]
        flash_attn_varlen_func=None, flash_attn_with_kvcache=None))  # imported by its attention layer, not run here
    try:
        import nanovllm.config
        import nanovllm.engine.model_runner
        import nanovllm.engine.scheduler
        import nanovllm.engine.sequence
        import nanovllm.sampling_params
    except ImportError as error:
        print(f"nano-vllm not measured: {error} (set NANO_VLLM_PATH to a checkout)")
        return None
    if path:
        return nanovllm, "nano-vllm (a checkout)"
    dist = next((d for d in ("nano-vllm", "nano-vllm-fork") if _version(d)), None)
    return nanovllm, f"{dist} {_version(dist)}" if dist else "nanovllm"


def _version(dist: str | None) -> str | None:
    try:
        return metadata.version(dist) if dist else None
    except metadata.PackageNotFoundError:
        return None


class NanoVLLM:
    """nano-vllm's host path around a stand-in model."""

    name = "nano-vllm"

    def __init__(self, nanovllm: types.ModuleType, batch: int, max_tokens: int, folder: Path) -> None:
        from transformers import Qwen2Config

        engine = nanovllm.engine
        Qwen2Config(vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(folder)
        config = nanovllm.config.Config(str(folder), max_num_seqs=batch, num_kvcache_blocks=batch * 4 + 8)
        config.eos = -1
        engine.sequence.Sequence.block_size = config.kvcache_block_size
        self.scheduler = engine.scheduler.Scheduler(config)
        runner = object.__new__(engine.model_runner.ModelRunner)  # its host methods only: no model, no device
        runner.config, runner.block_size, runner.enforce_eager = config, config.kvcache_block_size, True
        self.runner, self.table = runner, StandIn(batch).table
        with cpu_shim():
            if hasattr(runner, "_allocate_sample_buffers"):  # the fork's persistent buffers
                runner._allocate_sample_buffers()
            params = nanovllm.sampling_params.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
            for ids in prompts(batch):
                self.scheduler.add(engine.sequence.Sequence(ids, params))
            for _ in range(5):  # the prompts, then a few decodes
                self.step()

    def step(self) -> None:
        seqs, is_prefill = self.scheduler.schedule()
        (self.runner.prepare_prefill if is_prefill else self.runner.prepare_decode)(seqs)
        self.runner.prepare_sample(seqs)
        token_ids = self.table[: len(seqs)].argmax(dim=-1).tolist()  # the stand-in's sampler
        self.scheduler.postprocess(seqs, token_ids)


def cpu_ms(side, steps: int, shim: bool) -> float:
    """CPU milliseconds per step of ``steps`` steps."""
    with cpu_shim() if shim else contextlib.nullcontext():
        start = time.process_time()
        for _ in range(steps):
            side.step()
        return 1000 * (time.process_time() - start) / steps


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["minipaged_ms"] for r in rows], 0.4, label="minipaged (V1)")
    if data["nano_vllm"]:
        ax.bar([i + 0.2 for i in x], [r["nano_vllm_ms"] for r in rows], 0.4, label=data["nano_vllm"])
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("host CPU ms per decode step")
    ax.set_title("The host path, model nearly free")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = make_parser(__doc__, quick="20 steps, one run (default: 200 steps, the median of 5)",
                         plot_only="host_path")
    args = parser.parse_args()
    results_dir = results_dir_for(args)
    if getattr(args, "plot_only", False):
        import json

        plot(json.loads((results_dir / "host_path.json").read_text()), results_dir / "host_path.png")
        return
    torch.set_num_threads(1)  # the host path is one thread's work
    steps, repeats = (20, 1) if args.quick else (200, 5)
    nano = import_nano_vllm()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for batch in BATCHES:
            ours, theirs = [], []
            for _ in range(repeats):  # interleaved, so that both see the same machine
                ours.append(cpu_ms(Minipaged(batch, steps + 64), steps, shim=False))
                if nano is not None:
                    theirs.append(cpu_ms(NanoVLLM(nano[0], batch, steps + 64, Path(folder)), steps, shim=True))
            row = {"batch": batch, "minipaged_ms": statistics.median(ours),
                   "nano_vllm_ms": statistics.median(theirs) if theirs else None}
            row["ratio"] = row["minipaged_ms"] / row["nano_vllm_ms"] if theirs else None
            rows.append(row)
            print(f"batch {batch:>3}: minipaged {row['minipaged_ms']:.3f} ms" + (
                f", nano-vllm {row['nano_vllm_ms']:.3f} ms, ratio {row['ratio']:.2f}x" if theirs else ""))
    data = write_json(results_dir / "host_path.json", {
        "environment": environment("cpu"), "cores": len(os.sched_getaffinity(0)), "torch_threads": 1,
        "load": os.getloadavg()[0], "steps": steps, "repeats": repeats, "vocab": VOCAB, "prompt": PROMPT,
        "nano_vllm": nano[1] if nano else None, "rows": rows})
    plot(data, results_dir / "host_path.png")
    by = {r["batch"]: r for r in rows}
    print("host ms per decode step, batch 128 / 256: minipaged "
          f"{by[128]['minipaged_ms']:.2f} / {by[256]['minipaged_ms']:.2f}" + (
              f"; {nano[1]} {by[128]['nano_vllm_ms']:.2f} / {by[256]['nano_vllm_ms']:.2f} "
              f"({by[128]['ratio']:.2f}x / {by[256]['ratio']:.2f}x)" if nano else ""))


if __name__ == "__main__":
    main()
