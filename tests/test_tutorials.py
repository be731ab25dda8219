"""The tutorials show the stage's own code, read from the package by ``minipaged.show``.

Every function that holds a stage's solution appears in that stage's notebook, through a
``show(...)`` call of the function or of its class; what ``show`` displays is the file's
real text, with its real line numbers, and the solution lines are the ones it highlights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minipaged.exercise import solution_functions, solution_regions, stage_files
from minipaged.show import show
from minipaged.stage1_block_allocator import BlockAllocator

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parent.parent


def shown_names(notebook: Path) -> set[str]:
    """The last name of each ``show(...)`` argument in the notebook's code cells."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    return set(re.findall(r"\bshow\(\s*(?:[\w.]+\.)?(\w+)\s*[,)]", code))


def not_shown(path: Path, notebook: Path) -> list[str]:
    """Solutions the notebook does not show: neither the function nor a class around it."""
    shown = shown_names(notebook)
    return [name for name in solution_functions(path.read_text(), str(path))
            if not shown & set(name.split("."))]


@pytest.mark.parametrize("stage", range(10))
def test_each_notebook_shows_every_function_that_holds_its_stages_solution(stage):
    notebook = next((ROOT / "tutorials").glob(f"{stage:02d}_*.ipynb"))
    missing = not_shown(stage_files()[stage], notebook)
    assert not missing, f"{notebook.name} does not show {missing}"


def test_show_displays_the_files_own_lines_and_highlights_the_solution():
    shown = show(BlockAllocator.allocate)
    path = Path(shown.path)
    lines = path.read_text().splitlines(keepends=True)
    assert shown.text == "".join(lines[shown.first_line - 1 : shown.last_line])
    assert shown.lines[0].lstrip().startswith("def allocate")
    (begin, end, _), = [r for r in solution_regions(path.read_text())
                        if shown.first_line <= r[0] <= shown.last_line]
    assert shown.solution >= set(range(begin, end + 1))
    html = shown._repr_html_()
    assert "stage1_block_allocator.py" in html and "highlighted" in html
    assert shown.location.startswith("minipaged/stage1_block_allocator.py, lines ")
    clone = type(shown)(Path("/home/x/minipaged/minipaged/stage1.py"), 1, ["pass\n"], set())
    assert clone.location == "minipaged/stage1.py, lines 1–1"  # a clone folder named minipaged too
    assert html.count("background-color: #fff3c4") >= end - begin + 1  # each solution line


def test_show_cuts_a_piece_and_refuses_text_it_cannot_find():
    piece = show(BlockAllocator.allocate, start="BEGIN SOLUTION", stop="END SOLUTION")
    assert "BEGIN SOLUTION" in piece.lines[0] and "END SOLUTION" in piece.lines[-1]
    assert piece.first_line > show(BlockAllocator.allocate).first_line
    with pytest.raises(ValueError):
        show(BlockAllocator.allocate, start="no such text")
    with pytest.raises(TypeError):
        show(3)


def test_the_check_would_catch_a_notebook_that_shows_nothing(tmp_path):
    notebook = tmp_path / "01_x.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["print(1)\n"]}]}))
    assert shown_names(notebook) == set()
    assert "BlockAllocator.allocate" in not_shown(stage_files()[1], notebook)
