"""What every benchmark script shares: its command line and where its results go.

Each script answers one question, takes ``--quick`` for a short run and, where it draws a
plot from saved results, ``--plot-only``. A quick run writes under ``bench/results/quick/``:
it never replaces the full results whose plots the documentation shows.
"""

from __future__ import annotations

import argparse
import json
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


def results_dir_for(args: argparse.Namespace, custom: bool = False, create: bool = True) -> Path:
    """``bench/results/`` for the full run; ``quick/`` for a quick one and ``custom/`` for one
    with other settings, so that neither replaces the results the documentation shows."""
    path = RESULTS / "quick" if args.quick else RESULTS / "custom" if custom else RESULTS
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data, indent: int | None = 2) -> dict:
    """Write ``data`` to ``path``; return it as ``--plot-only`` reads it back."""
    path.write_text(json.dumps(data, indent=indent))
    return json.loads(path.read_text())
