"""Make ``import minipaged`` mean the package next to this file.

An exercise workspace is a copy of this folder with one stage stubbed; its tests must
grade the workspace's code, never a minipaged installed elsewhere.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))

import minipaged  # noqa: E402

if Path(minipaged.__file__).resolve().parent != ROOT / "minipaged":
    raise RuntimeError(
        f"the tests in {ROOT} would import minipaged from {minipaged.__file__}, "
        f"not from {ROOT / 'minipaged'}; run pytest from {ROOT}"
    )
