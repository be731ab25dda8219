"""``pytest -k`` over stage names selects exactly those stages: a stage's number is read whole.

Test ids here never contain a stage name, so that no ``-k`` over stage names selects them."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parents[1]
FILES = {0: "tests/test_stage0_contiguous.py", 1: "tests/test_stage1_block_allocator.py",
         10: "tests/test_stage10_v1_scheduler.py"}


def collected(*args):
    """The number of tests collected from each of ``FILES``, by stage."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:nbmake", *args, *FILES.values()], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]  # 5: nothing selected
    by_file = Counter(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line)
    return {number: by_file[path] for number, path in FILES.items() if by_file[path]}


def test_a_keyword_expression_over_stage_names_selects_exactly_those_stages():
    """``and``, ``or``, ``not`` and parentheses, in any case; only stage names are read whole, any
    other word matches part of a name as pytest's ``-k`` does (``contig``, in a file's name)."""
    either = collected("-k", "stage0 or stage1")
    assert set(either) == {0, 1}
    assert collected("-k", "stage1 and not stage10") == {1: either[1]}
    rest = collected("-k", "not stage1")
    assert set(rest) == {0, 10} and rest[0] == either[0]
    assert collected("-k", "(STAGE10 or stage0) and not contig") == {10: rest[10]}


def test_a_file_name_ending_in_a_stage_reads_its_number_whole():
    """``-k test_stage1``: the file-name form selects stage 1's file, not stage 10's."""
    assert set(collected("-k", "test_stage1")) == {1}
    assert set(collected("-k", "test_stage1 or test_stage0")) == {0, 1}
    assert set(collected("-k", "test_stage10")) == {10}
