"""The tutorials show the stage's own code, read from the package by ``minipaged.learn.show``.

Every function that holds a stage's solution appears in that stage's notebook, through a
``show(...)`` call of the function or of its class; what ``show`` displays is the file's
real text, with its real line numbers, and the solution lines are the ones it highlights.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from minipaged.learn.exercise import (
    make_workspace,
    solution_functions,
    solution_regions,
    stage_files,
    tutorial_for,
)
from minipaged.learn.show import show
from minipaged.stage1_block_allocator import BlockAllocator

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parent.parent


def shown_names(notebook: Path) -> set[str]:
    """The last name of each ``show(...)`` argument in the notebook's code cells."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    return set(re.findall(r"\bshow\(\s*(?:[\w.]+\.)?(\w+)\s*[,)]", code))


def not_shown(paths: list[Path], notebook: Path) -> list[str]:
    """Solutions of the files ``paths`` that the notebook does not show: neither the function
    nor a class around it."""
    shown = shown_names(notebook)
    return [name for path in paths for name in solution_functions(path.read_text(), str(path))
            if not shown & set(name.split("."))]


def undisplayed_shows(notebook: Path) -> list[str]:
    """The ``show(...)`` calls that Jupyter never displays: a statement of their own that is not the
    cell's last (only a cell's last expression is displayed; ``display(show(...))`` is, anywhere)."""
    missed = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(line if not line.lstrip().startswith(("%", "!")) else "pass\n" for line in cell["source"])
        body = ast.parse(source).body  # the IPython magics read as statements
        missed += [ast.unparse(statement) for statement in body[:-1] if isinstance(statement, ast.Expr)
                   and isinstance(statement.value, ast.Call) and ast.unparse(statement.value.func) == "show"]
    return missed


@pytest.mark.parametrize("notebook", sorted((ROOT / "tutorials").glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_show_in_a_notebook_is_displayed(notebook):
    assert not undisplayed_shows(notebook)


def test_the_display_check_catches_a_show_that_is_not_its_cells_last_expression(tmp_path):
    cells = [{"cell_type": "code", "source": ["show(a)\n", "show(b)"]},
             {"cell_type": "code", "source": ["display(show(c))\n", "x = 1"]}]
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    assert undisplayed_shows(notebook) == ["show(a)"]


@pytest.mark.parametrize("stage", sorted(stage_files()))
def test_each_notebook_shows_every_function_that_holds_its_stages_solution(stage):
    notebook = ROOT / tutorial_for(stage)
    missing = not_shown(stage_files()[stage], notebook)  # every file of the stage
    assert not missing, f"{notebook.name} does not show {missing}"


def test_show_displays_the_files_own_lines():
    shown = show(BlockAllocator.allocate)
    path = Path(shown.path)
    lines = path.read_text().splitlines(keepends=True)
    assert shown.text == "".join(lines[shown.first_line - 1 : shown.last_line])
    assert shown.lines[0].lstrip().startswith("def allocate")
    (begin, end, _), = [r for r in solution_regions(path.read_text())
                        if shown.first_line <= r[0] <= shown.last_line]
    assert shown.solution >= set(range(begin, end + 1))
    assert "stage1_block_allocator.py" in shown._repr_html_()
    assert shown.location.startswith("minipaged/stage1_block_allocator.py, lines ")
    clone = type(shown)(Path("/home/x/minipaged/minipaged/stage1.py"), 1, ["pass\n"], set())
    assert clone.location == "minipaged/stage1.py, lines 1–1"  # a clone folder named minipaged too


def code_lines(element) -> dict[int, str]:
    """The source lines shown in an HTML element, by the line number shown beside each."""
    found = {}
    for pre in element.find_all("pre"):
        for line in pre.get_text().splitlines():
            number, code = re.match(r"\s*(\d+)(.*)$", line).groups()
            found[int(number)] = code.strip()
    return found


@pytest.mark.parametrize("name", ["allocate", "free"])
def test_show_folds_the_solution_closed_and_shows_the_rest(name):
    """Rendered (a notebook, the site), the solution is behind "show the solution", closed."""
    from bs4 import BeautifulSoup

    shown = show(getattr(BlockAllocator, name))
    numbered = {n: line.strip() for n, line in enumerate(shown.lines, shown.first_line)}
    solution = {n: line for n, line in numbered.items() if n in shown.solution}
    rest = {n: line for n, line in numbered.items() if n not in shown.solution}
    assert solution and rest
    page = BeautifulSoup(shown._repr_html_(), "html.parser")
    folds = page.find_all("details")
    assert folds and all(not fold.has_attr("open") for fold in folds)
    assert all(fold.summary and "solution" in fold.summary.get_text() for fold in folds)
    folded = {n: line for fold in folds for n, line in code_lines(fold).items()}
    for fold in folds:
        fold.decompose()
    assert folded == solution and code_lines(page) == rest

    text = repr(shown)  # plain text: the marker lines stay, the solution's body is folded
    assert any("BEGIN SOLUTION" in line for line in text.splitlines())
    assert not [line for line in solution.values() if line and not line.startswith("#") and line in text]
    assert all(line in text for line in rest.values())
    assert shown.text.count("\n") == len(shown.lines)  # .text keeps every line


def test_a_piece_without_a_solution_folds_nothing():
    shown = show(BlockAllocator._check_id)
    assert not shown.solution & set(range(shown.first_line, shown.last_line + 1))
    assert "<details" not in shown._repr_html_() and repr(shown).endswith(shown.text)


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
    missing = not_shown(stage_files()[6], notebook)  # a stage of two files: the pieces of both
    assert "Scheduler._preempt" in missing and "SwapBlockSpaceManager.swap_in" in missing


# A learner's stage 1, written unlike the reference: each piece replaces one stub, in order.
LEARNER_STAGE1 = [
    "self.learner_total = num_blocks\n"
    "        self.learner_pool = sorted(range(num_blocks), reverse=True)\n"
    "        self.learner_taken = set()",
    "return self.learner_total",
    "return len(self.learner_pool)",
    "return block_id not in self.learner_taken",
    "if num_blocks > len(self.learner_pool):\n"
    "            raise OutOfBlocksError(num_blocks, len(self.learner_pool))\n"
    "        got = [self.learner_pool.pop() for _ in range(num_blocks)]\n"
    "        self.learner_taken.update(got)\n"
    "        return got",
    "if block_id not in self.learner_taken:\n"
    "            raise ValueError(block_id)\n"
    "        self.learner_taken.remove(block_id)\n"
    "        self.learner_pool.append(block_id)",
]


def learners_workspace(tmp_path: Path) -> Path:
    """A stage-1 workspace whose stubs the learner has filled in with code of their own."""
    workspace = make_workspace(1, tmp_path / "ws")
    (reference,) = stage_files()[1]
    path = workspace / "minipaged" / reference.name
    pieces = iter(LEARNER_STAGE1)
    text, count = re.subn(r"raise NotImplementedError\(.*\)", lambda _: next(pieces), path.read_text())
    assert count == len(LEARNER_STAGE1)
    path.write_text(text)
    return workspace


def reference_solution(stage: int) -> list[str]:
    """The code lines of a stage's solutions in the repository, in every file of it, comments left out."""
    found = []
    for path in stage_files()[stage]:
        lines = path.read_text().splitlines()
        found += [lines[n].strip() for begin, end, _ in solution_regions(path.read_text())
                  for n in range(begin, end - 1) if len(lines[n].strip()) > 12
                  and not lines[n].strip().startswith("#")]
    return found


def test_a_tutorial_run_in_a_workspace_imports_and_shows_the_learners_code(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    workspace = learners_workspace(tmp_path)
    notebook = workspace / "tutorials" / "01_block_allocator.ipynb"
    cells = nbformat.read(notebook, as_version=4)
    cells.cells.append(nbformat.v4.new_code_cell("import minipaged\nprint('package:', minipaged.__file__)"))
    NotebookClient(cells, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    outputs = "\n".join(
        str(value) for cell in cells.cells for output in cell.get("outputs", [])
        for value in [output.get("text", ""), *output.get("data", {}).values()])
    package = re.search(r"package: (\S+)", outputs)[1]
    assert Path(package).resolve().is_relative_to(workspace.resolve())  # the learner's code ran
    assert outputs.count("learner_pool") >= 5  # and is what show() displays
    solution = reference_solution(1)
    assert len(solution) >= 8
    assert not [line for line in solution if line in outputs], "the reference solution was shown"


def test_show_in_a_workspace_shows_the_learners_file_whatever_was_imported(tmp_path, monkeypatch):
    workspace = learners_workspace(tmp_path)
    monkeypatch.chdir(workspace / "tutorials")
    shown = show(BlockAllocator.allocate)  # imported from the repository, not the workspace
    assert Path(shown.path).resolve().is_relative_to(workspace.resolve())
    assert shown.lines[0].lstrip().startswith("def allocate") and "learner_pool.pop()" in shown.text
    assert not [line for line in reference_solution(1) if line in shown.text]
    assert "learner_taken" in show(BlockAllocator).text  # a class too
    monkeypatch.chdir(tmp_path)  # outside the workspace: the repository's own code
    assert "learner_pool" not in show(BlockAllocator.allocate).text
