"""What every benchmark script shares: its command line and where its results go.

Each script answers one question, takes ``--quick`` for a short run and, where it draws a
plot from saved results, ``--plot-only``. A quick run writes under ``bench/results/quick/``:
it never replaces the full results whose plots the documentation shows. A run on a GPU
(``--device cuda``) writes the same layout under ``bench/results/gpu/`` (``gpu/quick/`` for a
quick one): a GPU's figures never replace the CPU's, and they say which GPU and which versions
measured them (``environment``).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def make_parser(doc: str, quick: str, plot_only: str | None = None) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--quick`` (``quick`` says what it
    shortens) and, if ``plot_only`` names the results file, ``--plot-only``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    if plot_only:
        parser.add_argument("--plot-only", action="store_true",
                            help=f"redraw the plot from the saved results (bench/results/{plot_only}.json)")
    return parser


def add_device_arguments(parser: argparse.ArgumentParser, dtype: bool = True) -> None:
    """``--device`` (a GPU where there is one) and, with ``dtype``, ``--dtype`` (bfloat16 on a GPU,
    float32 on the CPU, as vLLM serves a model on a GPU in 16 bits); ``dtype_for`` fills it in."""
    import torch

    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where every side runs (default: cuda if there is a GPU)")
    if dtype:
        parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                            help="every side's weights and KV cache (default: bfloat16 on cuda, float32 on cpu)")


def dtype_for(args: argparse.Namespace) -> str:
    """``args.dtype``, or the device's default when it was not given."""
    return args.dtype or ("bfloat16" if on_gpu(args) else "float32")


def on_gpu(args: argparse.Namespace) -> bool:
    """Whether the run is on a CUDA device (``args.device``, ``"cpu"`` where a script has none)."""
    return str(getattr(args, "device", "cpu")).startswith("cuda")


def results_dir_for(args: argparse.Namespace, custom: bool = False, create: bool = True) -> Path:
    """``bench/results/`` for the full run; ``quick/`` for a quick one and ``custom/`` for one
    with other settings, so that neither replaces the results the documentation shows. On a GPU,
    the same under ``bench/results/gpu/``."""
    base = RESULTS / "gpu" if on_gpu(args) else RESULTS
    path = base / "quick" if args.quick else base / "custom" if custom else base
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def synchronize(device) -> None:
    """Wait until the device has run every kernel queued so far. A CUDA call returns once its kernels
    are queued, so a clock read around GPU work without this times their launch, not their run."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def environment(device) -> dict:
    """What a result was measured on and with, for its json: the device's name, the versions of
    torch, CUDA (``torch.version.cuda``; None in a CPU build), Triton and transformers, and the date."""
    import torch

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    gpu = torch.device(device).type == "cuda"
    return {"device_name": torch.cuda.get_device_name(device) if gpu else platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
            "transformers": version("transformers"),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_json(path: Path, data, indent: int | None = 2) -> dict:
    """Write ``data`` to ``path``; return it as ``--plot-only`` reads it back."""
    path.write_text(json.dumps(data, indent=indent))
    return json.loads(path.read_text())
