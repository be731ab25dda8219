"""Compare two lm-eval runs written with ``--output_path DIR --log_samples``: every request's
log-likelihood (``resps``) and every aggregated metric, side by side.

    python bench/lm_eval/compare.py build/lm_eval_results/server build/lm_eval_results/hf

``--json FILE --label NAME`` also keeps the comparison in FILE under NAME (the other labels kept):
bench/results/lm_eval_fp8.json holds the runs of stage 13's FP8 cache against transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def found(folder: Path, pattern: str) -> list[Path]:
    """The files under ``folder`` that match ``pattern``, oldest first."""
    return sorted(folder.rglob(pattern), key=lambda p: p.stat().st_mtime)


def results(folder: Path) -> dict:
    """The aggregated metrics of the newest run under ``folder``."""
    return json.loads(found(folder, "results_*.json")[-1].read_text())["results"]


def loglikelihoods(folder: Path) -> dict[tuple[str, int, int], float]:
    """(task, doc_id, request index) -> the log-likelihood lm-eval recorded (a newer run's replaces an older's)."""
    out = {}
    for path in found(folder, "samples_*.jsonl"):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            for i, resp in enumerate(sample["resps"]):
                value = resp[0][0] if isinstance(resp[0], list) else resp[0]
                out[(task, sample["doc_id"], i)] = float(value)
    return out


def cell(value) -> str:
    return f"{value:>12.6f}" if isinstance(value, float | int) else f"{value!s:>12}"


def summary(a: Path, b: Path) -> dict:
    """Both runs' metrics, and how far each task's log-likelihoods are apart: the largest and the mean."""
    ra, rb = results(a), results(b)
    la, lb = loglikelihoods(a), loglikelihoods(b)
    out: dict = {"metrics": {}, "loglikelihood_drift": {}}
    for task in sorted(ra):
        out["metrics"][task] = {metric: [ra[task][metric], rb.get(task, {}).get(metric)]
                                for metric in sorted(k for k in ra[task] if "," in k and "stderr" not in k)}
        diffs = [abs(la[k] - lb[k]) for k in la if k in lb and k[0] == task]
        out["loglikelihood_drift"][task] = {"requests": len(diffs), "largest": max(diffs, default=0.0),
                                            "mean": sum(diffs) / len(diffs) if diffs else 0.0}
    return out


def main(a: str, b: str, json_path: str | None = None, label: str | None = None) -> int:
    if json_path:
        kept = json.loads(Path(json_path).read_text()) if Path(json_path).is_file() else {}
        kept[label or Path(a).name] = summary(Path(a), Path(b))
        Path(json_path).write_text(json.dumps(kept, indent=2) + "\n")
    ra, rb = results(Path(a)), results(Path(b))
    print(f"{'task':<20} {'metric':<24} {Path(a).name:>12} {Path(b).name:>12}")
    for task in sorted(ra):
        for metric in sorted(k for k in ra[task] if "," in k and "stderr" not in k):
            va, vb = ra[task][metric], rb.get(task, {}).get(metric)
            print(f"{task:<20} {metric:<24} {cell(va)} {cell(vb)}")
    la, lb = loglikelihoods(Path(a)), loglikelihoods(Path(b))
    common = sorted(set(la) & set(lb))
    worst = max((abs(la[k] - lb[k]) for k in common), default=float("nan"))
    print(f"{len(common)} log-likelihoods in both runs ({len(la)} and {len(lb)}); largest difference {worst:.2e}")
    return 0 if common and len(common) == len(la) == len(lb) else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="one run's --output_path")
    parser.add_argument("b", help="the other's")
    parser.add_argument("--json", help="also keep the comparison in this file")
    parser.add_argument("--label", help="its name there (default: the first folder's)")
    args = parser.parse_args()
    sys.exit(main(args.a, args.b, args.json, args.label))
