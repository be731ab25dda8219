"""Make ``import minipaged`` mean the package next to this file, and Triton run without a GPU.

An exercise workspace is a copy of this folder with one stage stubbed; its tests must
grade the workspace's code, never a minipaged installed elsewhere. Without CUDA, Triton's
interpreter must be switched on before Triton is first imported, whoever imports it.
"""

import os
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
    """For the mutant catalogue: tests that build checkpoints run last, so a mutant fails sooner."""
    if os.environ.get("MINIPAGED_CHEAP_TESTS_FIRST"):
        items.sort(key=lambda item: "checkpoints" in getattr(item, "fixturenames", ()))
