"""Every stage has an exercise page that names each piece to write, its tests and its tutorial.

A piece is a function or method that holds a solution region; the page must name it by its
qualified name in backticks (``ContiguousKVCache.allocate``, ``dense_attention``), so a page
cannot silently miss a stub that the exercise tool writes, in any file of the stage; and the
page, like the stage's page in each language, names every file of the stage.
"""

from __future__ import annotations

import re

import pytest

from minipaged.learn.exercise import REPO_DIR, solution_functions, stage_files, tutorial_for

pytestmark = pytest.mark.tooling

PAGES = REPO_DIR / "docs" / "exercises"
STAGES = stage_files()  # stage -> its files, the main one first


def stage_tests(stage: int) -> list[str]:
    return sorted(f"tests/{p.name}" for p in (REPO_DIR / "tests").glob(f"test_stage{stage}_*.py"))


def problems(page: str, stage: int) -> list[str]:
    """What the exercise page of ``stage`` fails to name or link; empty when it is complete."""
    found = []
    for path in STAGES[stage]:
        if f"`minipaged/{path.name}`" not in page:
            found.append(f"the file minipaged/{path.name} is not named")
        for name in solution_functions(path.read_text(), str(path)):
            if f"`{name}`" not in page:
                found.append(f"the piece `{name}` is not named")
    for test_file in stage_tests(stage):
        if test_file not in page:
            found.append(f"the test file {test_file} is not named")
    tutorial = tutorial_for(stage)
    if f"](../{tutorial})" not in page:
        found.append(f"no link to the tutorial ../{tutorial}")
    stage_page = f"../stages/{STAGES[stage][0].stem.removeprefix('stage')}.md"
    if f"]({stage_page})" not in page:
        found.append(f"no link to the stage page {stage_page}")
    return found


def test_solution_functions_are_found_by_qualified_name():
    source = (
        "class A:\n"
        "    def f(self):\n"
        "        x = 1\n"
        "        # BEGIN SOLUTION\n"
        "        return x\n"
        "        # END SOLUTION\n"
        "\n"
        "    @property\n"
        "    def g(self):\n"
        "        # BEGIN SOLUTION\n"
        "        def helper():\n"
        "            return 2\n"
        "        return helper()\n"
        "        # END SOLUTION\n"
        "\n"
        "\n"
        "def h():\n"
        "    # BEGIN SOLUTION\n"
        "    pass\n"
        "    # END SOLUTION\n"
    )
    assert solution_functions(source) == ["A.f", "A.g", "h"]
    assert solution_functions(STAGES[1][0].read_text())[:2] == [
        "BlockAllocator.__init__",
        "BlockAllocator.num_total_blocks",
    ]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_exercise_page_names_every_piece_its_tests_and_its_tutorial(stage):
    page = PAGES / f"stage{stage}.md"
    assert page.is_file(), f"no exercise page {page.relative_to(REPO_DIR)}"
    assert stage_tests(stage), f"stage {stage} has no tests/test_stage{stage}_*.py"
    found = problems(page.read_text(), stage)
    assert not found, f"{page.relative_to(REPO_DIR)}: " + "; ".join(found)


def test_a_page_that_misses_a_piece_is_caught():
    page = (PAGES / "stage3.md").read_text()
    assert problems(page, 3) == []
    missing = re.sub(r"`CowBlockSpaceManager\.fork`", "`fork`", page)
    assert problems(missing, 3) == ["the piece `CowBlockSpaceManager.fork` is not named"]
    unlinked = page.replace("../tutorials/03_copy_on_write.ipynb", "03_copy_on_write.ipynb")
    assert problems(unlinked, 3) == ["no link to the tutorial ../tutorials/03_copy_on_write.ipynb"]


def test_a_page_that_misses_a_piece_of_a_stages_second_file_is_caught():
    page = (PAGES / "stage6.md").read_text()
    assert problems(page, 6) == []
    missing = page.replace("`minipaged/stage6_swapping.py`", "`stage6_swapping.py`")
    missing = re.sub(r"`SwapBlockSpaceManager\.swap_in`", "`swap_in`", missing)
    assert problems(missing, 6) == ["the file minipaged/stage6_swapping.py is not named",
                                    "the piece `SwapBlockSpaceManager.swap_in` is not named"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_stage_page_names_every_file_of_its_stage_in_each_language(stage):
    main = STAGES[stage][0].stem.removeprefix("stage")
    pages = [REPO_DIR / "docs" / "stages" / f"{main}{language}.md" for language in ("", ".zh")]
    assert pages[0].is_file(), f"no stage page docs/stages/{main}.md"
    for page in (p for p in pages if p.is_file()):
        header = next(line for line in page.read_text().splitlines() if line.startswith("*"))
        for path in STAGES[stage]:
            assert f"[`minipaged/{path.name}`](../api.md#minipaged.{path.stem})" in header, (page.name, path.name)


def test_the_exercises_index_links_every_stage_page():
    index = (PAGES / "index.md").read_text()
    for stage in STAGES:
        assert f"](stage{stage}.md)" in index, (
            f"docs/exercises/index.md does not link stage{stage}.md"
        )


def test_every_exercise_page_links_the_next():
    for stage in STAGES:
        page = (PAGES / f"stage{stage}.md").read_text()
        following = f"](stage{stage + 1}.md)" if stage + 1 in STAGES else "](index.md)"
        assert following in page, f"docs/exercises/stage{stage}.md does not link {following[2:-1]}"


def test_no_page_points_to_the_old_exercises_page():
    for path in [
        REPO_DIR / "README.md",
        *(REPO_DIR / "docs").rglob("*.md"),
        REPO_DIR / "minipaged" / "exercise.py",
    ]:
        if path.is_file() and "tutorials" not in path.parts:
            text = path.read_text()
            assert "exercises.md" not in text, (
                f"{path} points to exercises.md, now exercises/index.md"
            )


@pytest.fixture(scope="module")
def collected() -> dict[str, int]:
    """Tests per stage test file, as pytest collects them here."""
    import subprocess
    import sys
    from collections import Counter

    files = sorted(str(p.relative_to(REPO_DIR)) for p in (REPO_DIR / "tests").glob("test_stage*_*.py"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files],
                          cwd=REPO_DIR, capture_output=True, text=True)
    return Counter(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_exercise_page_counts_its_tests(stage, collected):
    page = (PAGES / f"stage{stage}.md").read_text()
    counted = re.search(r"`(tests/test_stage\d+_\w+\.py)` \((\d+) tests"
                        r"(?: on a CPU, (\d+) more on a CUDA device)?\)", page)
    assert counted, f"exercise {stage}'s page does not say how many tests it has"
    path, cpu, gpu = counted.group(1), int(counted.group(2)), int(counted.group(3) or 0)
    assert cpu + gpu == collected[path]
