"""The ``minipaged`` command: exercises, grading and the demo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _exercise(args: argparse.Namespace) -> int:
    from minipaged.exercise import make_workspace

    out = Path(args.out or f"minipaged-exercise-{args.stage}")
    workspace = make_workspace(args.stage, out, force=args.force)
    print(f"Exercise {args.stage} written to {workspace}.")
    print(f"Fill in the stubs, then run: cd {workspace} && pytest -k stage{args.stage}")
    return 0


def _grade(args: argparse.Namespace) -> int:
    from minipaged.exercise import format_grades, grade

    rows = grade(Path(args.directory), args.stage)
    print(format_grades(rows))
    return 0 if rows and all(r.status == "complete" for r in rows) else 1


def _demo(args: argparse.Namespace) -> int:
    from minipaged.simulate import (
        format_usage_table,
        simulate_contiguous,
        simulate_paged,
        synthetic_requests,
    )

    requests = synthetic_requests(args.requests, rate=args.rate, seed=args.seed)
    print(f"{len(requests)} ShareGPT-like requests (mean prompt "
          f"{sum(r.prompt_len for r in requests) / len(requests):.0f}, mean output "
          f"{sum(r.output_len for r in requests) / len(requests):.0f} tokens) served first come, "
          f"first served in one arena of {args.slots} token slots, max_model_len 2048.")
    print("Share of KV memory while requests wait for it: contiguous slabs under each "
          "reservation policy (stage 0), then blocks of 16 tokens (stage 2):\n")
    results = [simulate_contiguous(requests, p, args.slots, 2048) for p in ("max", "pow2", "oracle")]
    results.append(simulate_paged(requests, args.slots // 16, 16))
    print(format_usage_table(results))
    print("\nOnly 'token' holds K/V; 'running' is the batch size that memory allows.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minipaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("exercise", help="write a workspace where stage N's solutions are stubs")
    p.add_argument("stage", type=int)
    p.add_argument("--out", help="folder to write (default: ./minipaged-exercise-N)")
    p.add_argument("--force", action="store_true", help="replace the folder if it exists")
    p.set_defaults(run=_exercise)

    p = sub.add_parser("grade", help="run the stage tests of a workspace and print a table")
    p.add_argument("directory", nargs="?", default=".")
    p.add_argument("--stage", type=int, action="append", help="grade only this stage (repeatable)")
    p.set_defaults(run=_grade)

    p = sub.add_parser("demo", help="serve a synthetic workload and print where memory goes")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--slots", type=int, default=16384)
    p.add_argument("--rate", type=float, default=0.2, help="arrivals per decode step")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"minipaged {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
