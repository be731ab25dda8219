"""Every stage has an exercise page that names each piece to write, its tests and its tutorial.

A piece is a function or method that holds a solution region; the page must name it by its
qualified name in backticks (``ContiguousKVCache.allocate``, ``dense_attention``), so a page
cannot silently miss a stub that the exercise tool writes, in any file of the stage; and the
page, like the stage's page in each language, names every file of the stage.

The exercises are written in English (``stageN.md``) and in Chinese (``stageN.zh.md``). The
Chinese page is held to the same checks, and to the English page itself: the same test counts,
the same test names, the same links and as many hints, so that the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from minipaged.learn.exercise import REPO_DIR, solution_functions, stage_files, tutorial_for

pytestmark = pytest.mark.tooling

PAGES = REPO_DIR / "docs" / "exercises"
STAGES = stage_files()  # stage -> its files, the main one first
LANGUAGES = ("", ".zh")  # stage3.md, stage3.zh.md


def page_of(name: str, language: str) -> Path:
    return PAGES / f"{name}{language}.md"


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


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_exercise_page_names_every_piece_its_tests_and_its_tutorial(stage, language):
    page = page_of(f"stage{stage}", language)
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


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_exercises_index_links_every_stage_page(language):
    index = page_of("index", language).read_text()
    for stage in STAGES:
        assert f"](stage{stage}.md)" in index, (
            f"docs/exercises/index{language}.md does not link stage{stage}.md"
        )


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_exercise_page_links_the_next(language):
    for stage in STAGES:
        page = page_of(f"stage{stage}", language).read_text()
        following = f"](stage{stage + 1}.md)" if stage + 1 in STAGES else "](index.md)"
        assert following in page, f"docs/exercises/stage{stage}{language}.md does not link {following[2:-1]}"


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


# "`tests/test_stage5_x.py` (23 tests on a CPU, 9 more on a CUDA device)" in English,
# "`tests/test_stage5_x.py`（CPU 上 23 个测试，CUDA 设备上另有 9 个）" in Chinese.
COUNTS = {
    "": re.compile(r"`(tests/test_stage\d+_\w+\.py)` \((\d+) tests(?: on a CPU, (\d+) more on a CUDA device)?\)"),
    ".zh": re.compile(r"`(tests/test_stage\d+_\w+\.py)`（(?:CPU 上 )?(\d+) 个测试(?:，CUDA 设备上另有 (\d+) 个)?）"),
}


def counts(page: str, language: str) -> dict[str, tuple[int, int]]:
    """Each test file the page counts: its tests on a CPU, and those that need a CUDA device."""
    return {m.group(1): (int(m.group(2)), int(m.group(3) or 0)) for m in COUNTS[language].finditer(page)}


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_exercise_page_counts_its_tests(stage, language, collected):
    counted = counts(page_of(f"stage{stage}", language).read_text(), language)
    assert counted, f"exercise {stage}'s page{language} does not say how many tests it has"
    for path, (cpu, gpu) in counted.items():
        assert cpu + gpu == collected[path], (language, path)


# What the two languages of a page must share: the names in backticks that are tests, the
# links, the test counts and the hints.
TEST_NAME = re.compile(r"`((?:test_|Test)\w+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HINT = re.compile(r'^\s*\?\?\?\+? tip "', re.M)


def drift(english: str, chinese: str) -> list[str]:
    """How the Chinese version of an exercise page differs from the English one; empty when none."""
    found = []
    for what, pattern in (("test names", TEST_NAME), ("links", LINK)):
        en, zh = set(pattern.findall(english)), set(pattern.findall(chinese))
        if en != zh:
            found.append(f"{what}: only in English {sorted(en - zh)}, only in Chinese {sorted(zh - en)}")
    if counts(english, "") != counts(chinese, ".zh"):
        found.append(f"test counts: {counts(english, '')} in English, {counts(chinese, '.zh')} in Chinese")
    if len(HINT.findall(english)) != len(HINT.findall(chinese)):
        found.append(f"hints: {len(HINT.findall(english))} in English, {len(HINT.findall(chinese))} in Chinese")
    return found


@pytest.mark.parametrize("name", ["index", *(f"stage{stage}" for stage in sorted(STAGES))])
def test_the_chinese_exercise_page_says_what_the_english_one_says(name):
    english, chinese = page_of(name, ""), page_of(name, ".zh")
    assert chinese.is_file(), f"no Chinese exercise page {chinese.relative_to(REPO_DIR)}"
    found = drift(english.read_text(), chinese.read_text())
    assert not found, f"{chinese.relative_to(REPO_DIR)}: " + "; ".join(found)


def test_a_chinese_page_that_drifts_is_caught():
    english, chinese = page_of("stage5", "").read_text(), page_of("stage5", ".zh").read_text()
    assert drift(english, chinese) == []
    recounted = re.sub(r"CPU 上 (\d+) 个测试", lambda m: f"CPU 上 {int(m.group(1)) + 1} 个测试", chinese)
    assert [problem.split(":")[0] for problem in drift(english, recounted)] == ["test counts"]
    renamed = chinese.replace("`test_prefill_kernel_equals_the_reference`", "`test_prefill_kernel`")
    assert [problem.split(":")[0] for problem in drift(english, renamed)] == ["test names"]
    unlinked = chinese.replace("](stage6.md)", "](stage6.html)")
    assert [problem.split(":")[0] for problem in drift(english, unlinked)] == ["links"]
    hintless = chinese.replace('??? tip "', '??? note "', 1)
    assert [problem.split(":")[0] for problem in drift(english, hintless)] == ["hints"]


# The index's example grades and the mutant catalogue's last line, as the code gives them today:
# each stage's count of tests, the line of the test where a failure stops, the mutants.
GRADE_HEADER = "stage      passed  status"
GRADE_ROW = re.compile(r"(\d+) +(\d+)/(\d+)  (complete|in progress|not started)")
FAILED = re.compile(r" +failed: (\S+)")
WHERE = re.compile(r" +(tests/\S+\.py):(\d+): (.+)")
KILLED = re.compile(r"^mutants: (\d+)/(\d+) killed$", re.M)
MUTANT_ROW = re.compile(r"^(\d+) +(.+?) +(tests/\S+\.py)::(\w+)$", re.M)
FENCE = re.compile(r"^```\n(.*?)^```$", re.M | re.S)


def code_of_test(path: str, name: str) -> tuple[list[str], int, int]:
    """The lines of a test file, and where the code of its test ``name`` starts and ends (1-based):
    a function, a class, or a state machine's ``TestCase`` (its machine's class)."""
    source = (REPO_DIR / path).read_text()
    tree = ast.parse(source)
    nodes = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name]
                and isinstance(node.value, ast.Attribute) and node.value.attr == "TestCase"):
            name = ast.unparse(node.value.value)
    node = nodes[name]
    return source.splitlines(), node.lineno, node.end_lineno


def failing_line(nodeid: str, source: str) -> int | None:
    """The line of the named test's code that reads ``source``, if exactly one does."""
    path, name = nodeid.split("::")[:2]
    lines, first, last = code_of_test(path, name)
    found = [number for number in range(first, last + 1) if lines[number - 1].strip() == source]
    return found[0] if len(found) == 1 else None


def grade_problems(page: str, collected: dict[str, int]) -> list[str]:
    """What the index's example grades say that the tests of today do not: a stage's count of
    tests, a status or a number passed that its failures contradict, the line a failure is
    quoted at; and the mutant catalogue's size and its example row."""
    from minipaged.learn.mutants import CATALOGUE

    found, tables = [], [block for block in FENCE.findall(page) if block.startswith(GRADE_HEADER)]
    if len(tables) < 2:
        found.append(f"{len(tables)} grade tables, not 2")
    for table in tables:
        rows: list[list] = []
        for line in table.splitlines()[2:]:
            if row := GRADE_ROW.fullmatch(line):
                rows.append([*row.groups(), []])
            elif failure := FAILED.fullmatch(line):
                rows[-1][4].append([failure[1]])
            elif where := WHERE.fullmatch(line):
                rows[-1][4][-1].append(where.groups())
        for stage, passed, total, status, failures in rows:
            stage, passed, total = int(stage), int(passed), int(total)
            tests = sum(collected[path] for path in stage_tests(stage))
            if total != tests:
                found.append(f"stage {stage}: {total} tests, not {tests}")
            expected = {"complete": total, "not started": 0}.get(status, total - len(failures))
            if passed != expected or (status == "in progress" and not 0 < passed < total):
                found.append(f"stage {stage}: {passed}/{total} {status}, with {len(failures)} failures listed")
            for nodeid, *wheres in failures:
                assert wheres, f"{nodeid}: no line given"
                ((path, line, source),) = wheres
                at = failing_line(nodeid, source) if path == nodeid.split("::")[0] else None
                if at != int(line):
                    found.append(f"{nodeid}: fails at {path}:{line}, not at {path}:{at}")
    killed = KILLED.findall(page)
    if killed != [(str(len(CATALOGUE)),) * 2]:
        found.append(f"mutants: {killed}, not {len(CATALOGUE)}/{len(CATALOGUE)}")
    for stage, name, path, test in MUTANT_ROW.findall(page):
        if not any(m.stage == int(stage) and m.name == name for m in CATALOGUE):
            found.append(f"no mutant {name!r} in stage {stage}")
        if f"\ndef {test}(" not in (REPO_DIR / path).read_text():
            found.append(f"no test {path}::{test}")
    return found


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_example_grades_are_todays(language, collected):
    found = grade_problems(page_of("index", language).read_text(), collected)
    assert not found, f"docs/exercises/index{language}.md: " + "; ".join(found)


@pytest.mark.parametrize(("old", "new"), [
    ("0/67  not started", "0/47  not started"),
    ("67/67  complete", "47/47  complete"),
    ("19/21  in progress", "18/20  in progress"),
    ("19/21  in progress", "20/21  in progress"),
    ("21/21  complete", "16/16  complete"),
    ("21/21  complete", "19/21  complete"),
    ("block_allocator.py:79:", "block_allocator.py:69:"),
    ("block_allocator.py:114:", "block_allocator.py:104:"),
    ("6      admits while something", "6      admits while anything"),
    ("6      admits", "7      admits"),
    ("::test_rule_nothing_is_admitted_while_anything_waits_in_swap\n", "::test_rule_nothing_is_admitted\n"),
], ids=["not-started", "complete", "passed", "failures", "stage2", "status", "line", "machine-line", "mutant",
        "mutant-stage", "killed-by"])
def test_a_stale_example_grade_is_caught(old, new, collected):
    from minipaged.learn.mutants import CATALOGUE

    page = page_of("index", "").read_text()
    assert not grade_problems(page, collected) and page.count(old) == 1
    assert grade_problems(page.replace(old, new), collected)
    size = len(CATALOGUE)
    assert grade_problems(page.replace(f"{size}/{size} killed", f"{size - 1}/{size - 1} killed"), collected)
