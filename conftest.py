"""Make ``import minipaged`` mean the package next to this file, and Triton run without a GPU.

An exercise workspace is a copy of this folder with one stage stubbed; its tests must
grade the workspace's code, never a minipaged installed elsewhere. Without CUDA, Triton's
interpreter must be switched on before Triton is first imported, whoever imports it.
"""

import os
import re
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))

from hypothesis import settings  # noqa: E402

import minipaged  # noqa: E402

# In CI and in exercise workspaces, property-based tests draw the same examples every run:
# a red build can be replayed, and the same code always gets the same grade.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI") or (ROOT / ".minipaged-exercise").is_file():
    settings.load_profile("ci")

if Path(minipaged.__file__).resolve().parent != ROOT / "minipaged":
    raise RuntimeError(
        f"the tests in {ROOT} would import minipaged from {minipaged.__file__}, "
        f"not from {ROOT / 'minipaged'}; run pytest from {ROOT}"
    )


def pytest_collection_modifyitems(config, items):
    """For the mutant catalogue: tests that build checkpoints run last, so a mutant fails sooner.

    ``pytest -k stage1`` selects stage 1's tests and not stage 10's: in the one test command,
    a stage's number is read whole (pytest alone matches ``stage1`` inside ``stage10``)."""
    if os.environ.get("MINIPAGED_CHEAP_TESTS_FIRST"):
        items.sort(key=lambda item: "checkpoints" in getattr(item, "fixturenames", ()))
    stage = re.fullmatch(r"\s*stage(\d+)\s*", config.getoption("keyword") or "", re.I)
    if stage:
        whole = re.compile(rf"stage{stage.group(1)}(?!\d)", re.I)
        other = [item for item in items if not any(whole.search(name) for name in item.keywords)]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if item not in other]
