"""Make ``import minipaged`` mean the package next to this file, and Triton run without a GPU.

An exercise workspace is a copy of this folder with one stage stubbed; its tests must
grade the workspace's code, never a minipaged installed elsewhere. Without CUDA, Triton's
interpreter must be switched on before Triton is first imported, whoever imports it.
"""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs a test process per core), one torch thread each: two
# processes of two threads on two cores would only take the cores from one another.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

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


STAGE_NAME = re.compile(r"stage\d+", re.I)  # anywhere in a -k word: stage1, test_stage1, Stage10


def _stage_matcher(item):
    """pytest's ``-k`` matcher for ``item``, except that a word ending in a stage's number reads the
    number whole: ``stage1`` and ``test_stage1`` match ``test_stage1_block_allocator.py``, never
    ``test_stage10_v1_scheduler.py``."""
    from _pytest.mark import KeywordMatcher

    substring = KeywordMatcher.from_item(item)
    names = list(item.keywords)

    def matches(name, /, **kwargs):
        if not re.search(r"stage\d+$", name, re.I):
            return substring(name, **kwargs)  # stage1_block: nothing can follow the number but what is written
        whole = re.compile(re.escape(name) + r"(?!\d)", re.I)
        return any(whole.search(n) for n in names)

    return matches


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """For the mutant catalogue: tests that build checkpoints run last, so a mutant fails sooner.

    ``pytest -k`` reads a stage's number whole: ``-k stage1`` selects stage 1's tests and not
    stage 10's, and so does every expression over stage names (``-k "stage0 or stage1"``,
    ``-k "stage6 and not rule_"``); pytest alone matches ``stage1`` inside ``stage10``. The
    expression is evaluated here, by pytest's own parser, and pytest's own ``-k`` pass is
    given nothing more to do."""
    from _pytest.mark.expression import Expression

    if os.environ.get("MINIPAGED_CHEAP_TESTS_FIRST"):
        items.sort(key=lambda item: "checkpoints" in getattr(item, "fixturenames", ()))
    keyword = config.option.keyword
    try:
        expression = Expression.compile(keyword.strip()) if STAGE_NAME.search(keyword) else None
    except SyntaxError:  # pytest reports it, as it reports any bad -k
        expression = None
    if expression is None:
        return (yield)
    other = [item for item in items if not expression.evaluate(_stage_matcher(item))]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if item not in set(other)]
    config.option.keyword = ""
    try:
        return (yield)
    finally:
        config.option.keyword = keyword
