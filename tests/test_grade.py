"""The grader a teacher hands out: points per test and per stage, a teacher's own tests, blocked
GPU tests, Gradescope's results.json, and the shortcuts it refuses.

Every run grades the block allocator's exercise (its tests are quick) with ``--stage 1``; the
shortcuts found by reading the code are refused before any test runs. Test ids here never name a
stage, so that ``pytest -k stageN`` never selects them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from minipaged.learn.exercise import REPO_DIR, WORKSPACE_MARK, _digest, _workspace_files, make_workspace, stage_files
from minipaged.learn.grade import (
    RUBRIC,
    SCHEMA,
    Rubric,
    _harness,
    _outcome,
    exit_status,
    format_rubric,
    grade_report,
    integrity,
    rows,
    run_tests,
    scan_source,
    write_results,
)
from minipaged.learn.pytest_report import _foreign_modules, _starter

pytestmark = pytest.mark.common

CLI = [sys.executable, "-m", "minipaged.cli", "grade"]
(ALLOCATOR,) = stage_files()[1]
EXERCISES = REPO_DIR / "docs" / "exercises"
PAGE, PAGE_ZH = EXERCISES / "teachers.md", EXERCISES / "teachers.zh.md"
DOUBLE_FREE = ("        if self._is_free[block_id]:\n            raise ValueError(",
               "        if False:\n            raise ValueError(")  # a learner's allocator that accepts a double free


def _page_block(language: str, first_line: str, page: Path = PAGE) -> str:
    """The page's code block in ``language`` whose first line is ``first_line``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)
    return next(block for block in blocks if block.startswith(first_line))


def _teachers_tests(folder: Path) -> Path:
    """The teacher's private tests, as the page shows them."""
    source = _page_block("python", "# private/test_allocator_private.py")
    folder.mkdir()
    (folder / "test_allocator_private.py").write_text(source)
    return folder


def _workspace(tmp: Path, source: str | None = None) -> Path:
    """A workspace of the allocator's exercise, its stubs filled with ``source`` (or left as stubs)."""
    workspace = make_workspace(1, tmp / "ws")
    if source is not None:
        (workspace / "minipaged" / ALLOCATOR.name).write_text(source)
    return workspace


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A double-free bug graded with the teacher's tests: the printed report and results.json."""
    tmp = tmp_path_factory.mktemp("graded")
    wrong = ALLOCATOR.read_text().replace(*DOUBLE_FREE)
    assert wrong != ALLOCATOR.read_text()
    workspace = _workspace(tmp, wrong)
    private = _teachers_tests(tmp / "private")
    results = tmp / "out" / "results.json"
    done = subprocess.run([*CLI, str(workspace), "--stage", "1", "--tests", str(private), "--json",
                           "--format", "gradescope", "--output", str(results)], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr  # the stage is not complete
    return {"report": json.loads(done.stdout), "results": json.loads(results.read_text()), "workspace": workspace,
            "private": private, "source": wrong}


def _tests(report: dict) -> dict[str, dict]:
    return {test["id"]: test for row in report["stages"] for test in row["tests"]}


def test_the_report_gives_points_per_test_and_per_stage(graded):
    report = graded["report"]
    (row,) = report["stages"]
    tests = row["tests"]
    assert row["stage"] == 1 and row["points"] == RUBRIC.points[1] == report["points"]
    assert report["max_score"] == row["max_points"] == round(row["points"] - row["blocked_points"], 4)
    assert row["passed"] + row["failed"] + row["skipped"] + row["blocked"] == len(tests)
    assert 0 < row["passed"] and 0 < row["failed"] and row["status"] == "in progress"
    assert {t["points"] for t in tests} == {round(RUBRIC.points[1] / len(tests), 4)}  # equal weights
    assert all(t["score"] == (t["points"] if t["status"] == "passed" else 0) for t in tests)
    assert report["score"] == round(RUBRIC.points[1] * row["passed"] / len(tests), 4) == row["score"]
    assert all(t["reason"] for t in tests if t["status"] == "failed")  # where and why each failed


def test_the_teachers_tests_run_beside_the_public_ones(graded):
    tests = _tests(graded["report"])
    extra = {i.split("::")[1]: t for i, t in tests.items() if t["source"] == "extra"}
    assert extra["test_a_fresh_pool_hands_out_block_zero_first"]["status"] == "passed"
    assert extra["test_a_double_free_is_refused"]["status"] == "failed"  # the bug, caught by the teacher's test
    assert any(t["source"] == "public" and t["status"] == "failed" for t in tests.values())
    name = "tests/test_allocator_private.py"
    assert graded["report"]["extra_tests"] == {name: _digest(graded["private"] / "test_allocator_private.py")}
    assert not (graded["workspace"] / name).exists()  # the learner's folder never sees them


def test_a_test_that_needs_a_gpu_is_blocked_on_a_cpu_never_zero(graded):
    report = graded["report"]
    gpu = next(t for i, t in _tests(report).items() if i.endswith("::test_block_ids_index_a_cuda_tensor"))
    (row,) = report["stages"]
    if torch.cuda.is_available():
        assert gpu["status"] == "passed" and row["blocked"] == 0
    else:
        assert gpu["status"] == "blocked" and row["blocked"] == 1 and report["blocked_points"] == gpu["points"] > 0
        assert report["environment"]["gpus"] == []
        assert row["max_points"] == round(row["points"] - gpu["points"], 4)  # held back: out of the maximum


def test_the_report_names_the_graded_files_and_the_machine(graded):
    report = graded["report"]
    assert report["schema"] == SCHEMA and report["workspace_stage"] == 1
    graded_file = graded["workspace"] / "minipaged" / ALLOCATOR.name
    assert report["files"] == {f"minipaged/{ALLOCATOR.name}": _digest(graded_file)}
    environment = report["environment"]
    assert environment["python"] == ".".join(map(str, sys.version_info[:3]))
    assert environment["torch"] == torch.__version__.split("+")[0] or environment["torch"] == torch.__version__
    assert {"triton", "platform", "cpu", "cpu_count", "cuda", "gpus"} <= set(environment)
    assert report["refused"] == [] and report["checked"]["tests_unchanged"]


GRADESCOPE_STATUS = {"passed", "failed"}  # what Gradescope's results.json allows
GRADESCOPE_VISIBILITY = {"visible", "hidden", "after_due_date", "after_published"}


def test_results_json_is_gradescopes_format(graded):
    report, results = graded["report"], graded["results"]
    assert results["score"] == report["score"] and results["extra_data"]["schema"] == SCHEMA
    assert results["extra_data"]["max_score"] == report["max_score"]
    assert {results["visibility"], results["stdout_visibility"]} <= GRADESCOPE_VISIBILITY
    assert all(t.get("status", "passed") in GRADESCOPE_STATUS and t["visibility"] in GRADESCOPE_VISIBILITY
               for t in results["tests"])
    assert results["score"] == pytest.approx(sum(t["score"] for t in results["tests"]), abs=1e-3)
    assert report["max_score"] == pytest.approx(sum(t["max_score"] for t in results["tests"]), abs=1e-3)
    tests = {t["name"]: t for t in results["tests"]}
    assert set(tests) == set(_tests(report)) and len(tests) == len(results["tests"])  # one entry per test
    for name, test in _tests(report).items():
        entry = tests[name]
        if test["status"] == "blocked":
            assert entry["max_score"] == entry["score"] == 0 and "status" not in entry
        else:
            assert (entry["score"], entry["max_score"]) == (test["score"], test["points"])
            assert entry["status"] == ("passed" if test["status"] == "passed" else "failed")
        assert entry["visibility"] == ("after_published" if test["source"] == "extra" else "visible")


def test_stubs_score_nothing(tmp_path):
    report = grade_report(_workspace(tmp_path), [1])
    (row,) = report["stages"]
    assert row["passed"] == 0 and row["failed"] == len(row["tests"]) > 0
    assert report["score"] == 0 and row["status"] == "not started" and report["refused"] == []


def test_the_rubric_shows_each_tests_points_without_running_them(tmp_path, graded):
    done = subprocess.run([*CLI, str(_workspace(tmp_path)), "--stage", "1", "--rubric", "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rubric = json.loads(done.stdout)
    assert rubric["points"] == {str(s): p for s, p in RUBRIC.points.items()}
    (row,) = rubric["stages"]
    public = [t for t in _tests(graded["report"]).values() if t["source"] == "public"]
    assert len(row["tests"]) == len(public) and {t["status"] for t in row["tests"]} == {"collected"}
    assert sum(t["points"] for t in row["tests"]) == pytest.approx(RUBRIC.points[1], abs=1e-3)


def test_weights_share_a_stages_points():
    rubric = Rubric(points={1: 6}, weights=(("*::test_heavy*", 2.0),))
    assert rubric.test_points(1, ["t.py::test_heavy", "t.py::a", "t.py::b", "t.py::c"]) == {
        "t.py::test_heavy": 2.4, "t.py::a": 1.2, "t.py::b": 1.2, "t.py::c": 1.2}
    assert rubric.test_points(2, ["t.py::a"]) == {"t.py::a": 0.0}  # a stage the rubric does not name


@pytest.fixture(scope="module")
def clean_workspace(tmp_path_factory):
    return _workspace(tmp_path_factory.mktemp("clean"), ALLOCATOR.read_text())


SHORTCUTS = {
    "importlib": ("import importlib\n", "reference"),
    "sys-path": ("import sys\nsys.path.insert(0, '/elsewhere')\n", "reference"),
    "installed-copy": ("SOURCE = open('/usr/lib/python3/site-packages/minipaged/x.py').read\n", "reference"),
    "package-file": ("import minipaged\nHOME = minipaged.__file__\n", "reference"),
    "exec": ("exec('x = 1')\n", "reference"),
    "test-module": ("import test_stage1_block_allocator\n", "reads-tests"),
    "test-file": ("TESTS = 'tests/test_stage1_block_allocator.py'\n", "reads-tests"),
    "pytest": ("import pytest\n", "reads-tests"),
    "frames": ("import inspect\n", "reads-tests"),
    "grader": ("from minipaged.learn import pytest_report\n", "reads-tests"),
    "grader-relative": ("from . import learn\n", "reads-tests"),
    "grader-plugin": ("import minipaged_grade_plugin\n", "reads-tests"),
    "unittest": ("import unittest\n", "reads-tests"),  # its SkipTest skips a test
    "subprocess": ("import subprocess\n", "reads-tests"),  # a process reads what no hook sees
    "pty": ("import pty\n", "reads-tests"),
    "ctypes": ("import ctypes\n", "reads-tests"),
    "os-system": ("import os\nRUN = os.system\n", "reads-tests"),
    "os-popen-aliased": ("import os as o\nRUN = o.popen\n", "reads-tests"),
    "os-exec": ("from os import execvp\n", "reads-tests"),
    "posix-spawn": ("import os\nRUN = os.posix_spawn\n", "reads-tests"),
    "asyncio-subprocess": ("import asyncio\nRUN = asyncio.create_subprocess_shell\n", "reads-tests"),
}


@pytest.mark.parametrize("name", sorted(SHORTCUTS))
def test_a_shortcut_in_the_learners_file_is_refused_before_any_test_runs(name, clean_workspace):
    line, rule = SHORTCUTS[name]
    target = clean_workspace / "minipaged" / ALLOCATOR.name
    reference = ALLOCATOR.read_text()
    target.write_text(reference.replace("from __future__ import annotations\n",
                                        f"from __future__ import annotations\n\n{line}", 1))
    try:
        report = grade_report(clean_workspace, [1])
    finally:
        target.write_text(reference)
    assert [r["rule"] for r in report["refused"]] and {r["rule"] for r in report["refused"]} == {rule}
    assert all(r["where"].startswith(f"minipaged/{ALLOCATOR.name}:") for r in report["refused"])
    assert report["score"] == 0 and report["stages"][0]["status"] == "refused" and report["stages"][0]["tests"] == []


@pytest.mark.parametrize("change", ["edited", "deleted", "added"])
def test_a_workspace_whose_tests_changed_is_refused(change, clean_workspace):
    tests = clean_workspace / "tests"
    target = tests / ("conftest_extra.py" if change == "added" else "test_stage1_block_allocator.py")
    before = target.read_bytes() if target.exists() else None
    if change == "edited":
        target.write_text(before.decode().replace("assert ", "assert True or ", 1))
    elif change == "deleted":
        target.unlink()
    else:
        target.write_text("import pytest\n")
    try:
        report = grade_report(clean_workspace, [1])
    finally:
        target.unlink(missing_ok=True)
        if before is not None:
            target.write_bytes(before)
    assert [(r["rule"], r["where"]) for r in report["refused"]] == [("tests-edited", f"tests/{target.name}")]
    assert report["score"] == 0


def test_a_shortcut_the_code_hides_is_caught_while_the_tests_run(tmp_path):
    """Paths built at run time: the learner's allocator reads a test helper and the installed copy."""
    source = ALLOCATOR.read_text().replace("from __future__ import annotations\n",
                                           "from __future__ import annotations\n\nimport os\n", 1)
    hidden = (f'        self._seen = [open(os.path.join(os.getcwd(), "te" + "sts", "helpers_kv.py")).read(),\n'
              f'                      open({str(ALLOCATOR)!r}).read()]\n')
    source = source.replace('        check_int("num_blocks", num_blocks, 1)\n',
                            f'        check_int("num_blocks", num_blocks, 1)\n{hidden}', 1)
    assert "_seen" in source and scan_source(source, ALLOCATOR.name) == []  # the code alone does not show it
    report = grade_report(_workspace(tmp_path, source), [1])
    reasons = {(r["rule"], r["reason"].split()[1]) for r in report["refused"]}
    assert reasons == {("reads-tests", "tests/helpers_kv.py"), ("reference", str(ALLOCATOR))}
    assert all(r["where"].startswith(f"minipaged/{ALLOCATOR.name}:") for r in report["refused"])
    assert report["score"] == 0 and report["stages"][0]["status"] == "refused"


def test_no_file_of_the_package_is_taken_for_a_shortcut():
    for path in sorted((REPO_DIR / "minipaged").glob("stage*_*.py")):
        assert scan_source(path.read_text(), path.name) == [], path.name


def test_results_are_written_only_over_a_previous_results_file(tmp_path):
    path = tmp_path / "results.json"
    write_results(path, {"schema": SCHEMA, "score": 1})
    write_results(path, {"schema": SCHEMA, "score": 2})  # a previous report is replaced
    assert json.loads(path.read_text())["score"] == 2
    mine = tmp_path / "notes.json"
    mine.write_text('{"score": 9}')
    with pytest.raises(FileExistsError):
        write_results(mine, {"schema": SCHEMA})
    assert mine.read_text() == '{"score": 9}'
    write_results(mine, {"schema": SCHEMA}, force=True)
    assert json.loads(mine.read_text()) == {"schema": SCHEMA}
    with pytest.raises(FileExistsError):
        write_results(tmp_path, {"schema": SCHEMA}, force=True)  # never a folder


@pytest.mark.parametrize("page", [PAGE, PAGE_ZH], ids=lambda page: page.name)
def test_the_pages_example_is_what_the_grader_prints(page, graded):
    """Each page's JSON is a run of its own commands (its list of tests cut short): the same fields,
    points, outcomes and digests."""
    if torch.cuda.is_available():
        pytest.skip("the page's example ran on a machine without a GPU")
    example = json.loads(_page_block("json", "{", page))
    assert _page_block("python", "# private/test_allocator_private.py", page) == _page_block(
        "python", "# private/test_allocator_private.py")  # the tests it was graded with
    report = graded["report"]
    assert set(example) == set(report) and set(example["environment"]) == set(report["environment"])
    (shown,), (row,) = example["stages"], report["stages"]
    assert {k: v for k, v in shown.items() if k != "tests"} == {k: v for k, v in row.items() if k != "tests"}
    tests = _tests(report)
    for test in shown["tests"]:
        ran = tests[test["id"]]
        assert {k: test[k] for k in ("source", "status", "points", "score")} == {
            k: ran[k] for k in ("source", "status", "points", "score")}
    assert {t["status"] for t in shown["tests"]} == {"passed", "failed", "blocked"}
    for key in ("score", "max_score", "blocked_points", "extra_tests", "rubric", "refused", "schema"):
        assert example[key] == report[key], key
    assert example["files"].keys() == report["files"].keys()  # the digests change with the stage's file
    assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in example["files"].values())


# --- the rubric and the exercises' stars -------------------------------------------------------

STAR_ROW = re.compile(r"^\| \[(\d+) · [^\]\n]*\]\(stage(\d+)\.md\) \|[^|\n]*\| (★*)☆* \|", re.M)


@pytest.mark.parametrize("page", ["index.md", "index.zh.md"])
def test_the_rubric_gives_five_points_per_star_of_the_exercises_table(page):
    rows = STAR_ROW.findall((EXERCISES / page).read_text())
    assert all(number == link for number, link, _ in rows)
    stars = {int(number): len(full) for number, _, full in rows}
    assert len(stars) == len(rows) and stars.keys() == set(stage_files()) == RUBRIC.points.keys()
    assert {stage: 5 * n for stage, n in stars.items()} == RUBRIC.points


def test_the_rubric_prints_each_tests_points_as_its_json_gives_them(tmp_path):
    workspace = _workspace(tmp_path)
    shown = subprocess.run([*CLI, str(workspace), "--stage", "1", "--rubric", "--json"], capture_output=True, text=True)
    text = subprocess.run([*CLI, str(workspace), "--stage", "1", "--rubric"], capture_output=True, text=True)
    assert shown.returncode == text.returncode == 0, shown.stderr + text.stderr
    rubric, lines = json.loads(shown.stdout), text.stdout.splitlines()
    (row,) = rubric["stages"]
    assert float(re.match(r"rubric: ([\d.]+) points", lines[0])[1]) == rubric["total"] == sum(RUBRIC.points.values())
    stage = [re.fullmatch(r"stage (\d+): ([\d.]+) points, (\d+) tests", line) for line in lines]
    assert [(int(m[1]), float(m[2]), int(m[3])) for m in stage if m] == [(1, RUBRIC.points[1], len(row["tests"]))]
    printed = [re.fullmatch(r" +([\d.]+)  (\S+)( \(extra\))?", line) for line in lines]
    assert {m[2]: float(m[1]) for m in printed if m} == {t["id"]: t["points"] for t in row["tests"]}
    assert format_rubric({"rubric": rubric, "stages": rubric["stages"]}) == text.stdout.rstrip("\n")


# --- what the grader trusts: its own copy, never the learner's -----------------------------------

def _edit(path: Path) -> None:
    path.write_text(path.read_text().replace("assert ", "assert True or ", 1) + "\n# edited\n")


def test_a_rewritten_list_of_files_does_not_hide_an_edited_test(tmp_path):
    """The workspace's marker lists the files with their digests; a learner can rewrite it."""
    workspace = _workspace(tmp_path, ALLOCATOR.read_text())
    _edit(workspace / "tests" / "test_stage1_block_allocator.py")
    first = (workspace / WORKSPACE_MARK).read_text().splitlines()[0]
    listed = [f"{_digest(path)}  {name}" for name, path in _workspace_files(workspace).items()]
    (workspace / WORKSPACE_MARK).write_text(first + "\n" + "\n".join(listed) + "\n")
    report = grade_report(workspace, [1])
    assert [(r["rule"], r["where"]) for r in report["refused"]] == [
        ("tests-edited", "tests/test_stage1_block_allocator.py")]
    assert report["score"] == 0 and report["stages"][0]["status"] == "refused"


def test_a_folder_without_the_exercise_marker_is_refused(tmp_path):
    workspace = _workspace(tmp_path, ALLOCATOR.read_text())
    (workspace / WORKSPACE_MARK).unlink()
    report = grade_report(workspace, [1])
    assert [(r["rule"], r["where"]) for r in report["refused"]] == [("not-a-workspace", WORKSPACE_MARK)]
    assert report["score"] == 0 and report["stages"][0]["status"] == "refused" and report["stages"][0]["tests"] == []


def test_the_tests_run_with_the_graders_files_and_only_the_learners_stage_files(tmp_path):
    """Whatever the workspace holds besides its stage files, the scratch copy holds the grader's."""
    learners = ALLOCATOR.read_text().replace(*DOUBLE_FREE)
    workspace = _workspace(tmp_path, learners)
    theirs = ["conftest.py", "pyproject.toml", "tests/test_stage1_block_allocator.py", "tests/helpers_kv.py",
              "minipaged/learn/grade.py", "minipaged/learn/pytest_report.py", "minipaged/__init__.py"]
    for name in theirs:
        _edit(workspace / name)
    (table,) = stage_files()[2]
    (workspace / "minipaged" / table.name).unlink()  # stays missing: the grader's own copy is a solution
    into = tmp_path / "scratch"
    into.mkdir()
    assert _harness(workspace, None, into) == []
    for name in theirs:
        assert _digest(into / name) == _digest(REPO_DIR / name), name
    assert (into / "minipaged" / ALLOCATOR.name).read_text() == learners
    assert not (into / "minipaged" / table.name).exists()
    assert not (into / "minipaged" / "learn" / "mutants.py").exists()  # it quotes every solution
    refused, checked = integrity(workspace, [1])
    assert sorted((r["rule"], r["where"]) for r in refused) == sorted(
        [("tests-edited", name) for name in theirs if name != "minipaged/__init__.py"]
        + [("not-a-workspace", f"minipaged/{table.name}")])
    assert checked["not_run"] == ["minipaged/__init__.py"] and not checked["tests_unchanged"]
    assert checked["files_read"] == [f"minipaged/{ALLOCATOR.name}"]


def test_the_report_is_written_by_the_graders_plugin_not_the_folders(tmp_path):
    workspace = _workspace(tmp_path, ALLOCATOR.read_text())
    forged = ("import json, os\n\n\ndef pytest_sessionfinish(session):\n"
              "    with open(os.environ['MINIPAGED_REPORT'], 'w') as f:\n"
              "        json.dump({'forged.py::test': {'outcome': 'passed', 'stages': [1]}}, f)\n")
    (workspace / "minipaged" / "learn" / "pytest_report.py").write_text(forged)
    records = run_tests(workspace, "-m", "stage1", "--collect-only")
    assert "forged.py::test" not in records
    assert records and all(r["stages"] == [1] for r in records.values())
    assert all(nodeid.startswith("tests/test_stage1_block_allocator.py::") for nodeid in records)


def test_modules_loaded_from_the_reference_package_are_named():
    reference = str(Path(json.__file__).parent) + "/"
    found = _foreign_modules(reference, "/the/workspace/minipaged/")
    assert "json" in {f["where"] for f in found} and {f["rule"] for f in found} == {"reference"}
    assert all(sys.modules[f["where"]].__file__.startswith(reference) for f in found)
    assert _foreign_modules(None, "/the/workspace/minipaged/") == []
    assert _foreign_modules(str(tmp := REPO_DIR / "no-such-folder") + "/", str(tmp)) == []


def test_a_teachers_test_with_the_name_of_a_public_one_is_refused(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    (private / "test_stage1_block_allocator.py").write_text("def test_nothing():\n    pass\n")
    with pytest.raises(ValueError, match="rename it"):
        grade_report(_workspace(tmp_path, ALLOCATOR.read_text()), [1], extra_tests=private)


# --- blocked tests ---------------------------------------------------------------------------------

CPU, GPU, NO_TRITON = {"gpus": [], "triton": "3.9.0"}, {"gpus": ["NVIDIA H200"], "triton": "3.9.0"}, {"gpus": []}


@pytest.mark.parametrize("reason, record, machine, status", [
    ("Skipped: needs a CUDA device", {}, CPU, "blocked"),
    ("Skipped: needs a CUDA device", {}, GPU, "skipped"),  # a GPU here: nothing is blocked by one
    ("Skipped: this Triton build ships no ptxas", {}, CPU, "blocked"),
    ("Skipped: this Triton build ships no ptxas", {}, GPU, "blocked"),  # a tool missing anywhere
    ("Skipped: needs Triton, which cannot be imported here", {}, NO_TRITON, "blocked"),
    ("Skipped: needs Triton, which cannot be imported here", {}, CPU, "skipped"),  # Triton is here
    ("Skipped: not a git checkout", {}, CPU, "skipped"),
    ("Skipped: needs a CUDA device", {"skipped_in": f"minipaged/{ALLOCATOR.name}:9"}, CPU, "skipped"),
    ("Skipped: needs Triton", {"skipped_in": f"minipaged/{ALLOCATOR.name}:9"}, NO_TRITON, "skipped"),
])
def test_a_skip_is_blocked_when_the_machine_lacks_what_the_test_needs(reason, record, machine, status):
    assert _outcome({"outcome": "skipped", "stages": [1], "reason": [reason], **record}, RUBRIC, machine) == status


NO_TRITON_HERE = '''"""Python as on a machine where Triton is not built (it is for Linux on x86-64 only)."""
import sys


class NoTriton:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
'''


def test_the_triton_kernels_are_blocked_not_lost_where_triton_cannot_be_imported(tmp_path, monkeypatch):
    """Stage 5's tests need Triton: where it cannot be imported they are collected all the same,
    and blocked, their points held back; the stage is not scored 0 of its points."""
    python = tmp_path / "python"
    python.mkdir()
    (python / "sitecustomize.py").write_text(NO_TRITON_HERE)  # every Python the grader starts has no Triton
    monkeypatch.setenv("PYTHONPATH", str(python))
    report = grade_report(make_workspace(5, tmp_path / "ws"), [1, 5])
    assert report["refused"] == [] and report["environment"]["triton"] is None
    allocator, kernels = report["stages"]
    assert kernels["stage"] == 5 and kernels["tests"] and kernels["status"] == "blocked"
    assert {t["status"] for t in kernels["tests"]} == {"blocked"} and kernels["blocked"] == len(kernels["tests"])
    assert kernels["blocked_points"] == kernels["points"] == RUBRIC.points[5] and kernels["max_points"] == 0
    assert allocator["status"] == "complete" and report["max_score"] == allocator["max_points"]
    assert [row.status for row in rows(report)] == ["complete", "blocked"]  # the table says so too
    assert exit_status(report) == 0  # the blocked stage is graded again where Triton runs


def _status(*stages: str, refused: bool = False) -> int:
    return exit_status({"stages": [{"status": s} for s in stages], "refused": [{"rule": "reads-tests"}] * refused})


def test_the_exit_status_is_0_only_when_every_graded_stage_is_done():
    assert _status("complete") == _status("complete", "blocked") == 0
    assert _status("complete", "no tests") == 1  # its points are in the maximum, none earned
    assert _status("complete", "in progress") == _status("blocked") == _status("complete", refused=True) == 1


SKIP_FROM_THE_PACKAGE = '''

_SKIPS = []


def _skip(reason):
    """Raise a skip from a learner's file, as if the test had skipped itself, found without importing
    pytest or unittest: pytest's own (``Skipped``) and unittest's (``SkipTest``) in turn."""
    _SKIPS.append(reason)
    name = ("Skipped", "SkipTest")[len(_SKIPS) % 2]
    classes = [BaseException]
    while classes:
        cls = classes.pop()
        if cls.__name__ == name:
            raise cls(reason)
        classes.extend(getattr(cls, "__subcl" + "asses__")())
'''


def test_a_skip_the_learners_code_raises_is_never_blocked(tmp_path):
    """Blocked tests leave the maximum: a learner's code that skips a test, with the reason a GPU
    test gives, must not turn its failure into a smaller maximum. pytest turns unittest's
    ``SkipTest`` into a skip of its own, raised from pytest's code: it is the learner's all the same."""
    source = ALLOCATOR.read_text().replace("\n\nclass ", SKIP_FROM_THE_PACKAGE + "\n\nclass ", 1)
    source = source.replace('        check_int("num_blocks", num_blocks, 1)\n',
                            '        check_int("num_blocks", num_blocks, 1)\n'
                            '        if num_blocks == 4:\n            _skip("needs a CUDA device")\n', 1)
    assert "_skip(" in source and scan_source(source, ALLOCATOR.name) == []  # the code alone does not show it
    report = grade_report(_workspace(tmp_path, source), [1])
    (row,) = report["stages"]
    skipped = [t for t in row["tests"] if t["status"] not in ("passed", "failed")]
    assert len(skipped) >= 2 and {t["status"] for t in skipped} == {"skipped"}  # both kinds of skip
    assert all(t["skipped_in"].startswith(f"minipaged/{ALLOCATOR.name}:") for t in skipped)
    assert row["blocked"] == 0 and report["blocked_points"] == 0
    assert report["max_score"] == RUBRIC.points[1] > report["score"]


# What a learner's allocator starts as it is first made; the code hides it from the scan.
STARTS = {
    "refused": ['getattr(os, "po" + "pen")("cat " + os.path.join("te" + "sts", "helpers_kv.py")).read()',
                'getattr(os, "sys" + "tem")("true")'],  # a shell that reads a test, and a command
    "allowed": ['multiprocessing.get_context("fork").Process(target=int, daemon=True).start()',  # its own Python
                'torch.utils.collect_env.run("true")'],  # a package it uses starts the process
}


@pytest.mark.parametrize("case", sorted(STARTS))
def test_a_process_the_learners_code_starts_is_refused_while_the_tests_run(case, tmp_path):
    """A child process reads what no audit hook of the tests' process sees. multiprocessing's
    children run the learner's own Python (stage 11's workers), and a package that starts a
    process (Triton runs ptxas) is not the learner's code: neither is refused."""
    source = ALLOCATOR.read_text().replace("from __future__ import annotations\n",
                                           "from __future__ import annotations\n\nimport multiprocessing\nimport os\n"
                                           "\nimport torch.utils.collect_env\n\n_STARTED = []\n", 1)
    starts = "".join(f"            _STARTED.append({start})\n" for start in STARTS[case])
    source = source.replace('        check_int("num_blocks", num_blocks, 1)\n',
                            f'        check_int("num_blocks", num_blocks, 1)\n        if not _STARTED:\n{starts}', 1)
    assert "_STARTED.append" in source and scan_source(source, ALLOCATOR.name) == []
    report = grade_report(_workspace(tmp_path, source), [1])
    if case == "refused":
        assert len(report["refused"]) == 2 and {r["rule"] for r in report["refused"]} == {"reads-tests"}
        assert all(r["where"].startswith(f"minipaged/{ALLOCATOR.name}:") for r in report["refused"])
        assert report["score"] == 0 and report["stages"][0]["status"] == "refused"
    else:
        assert report["refused"] == [] and report["score"] > 0


def test_only_the_learners_own_files_are_taken_to_start_a_process(tmp_path):
    """The first frame past the standard library decides: a learner's file, or code it uses (the
    package's own server launcher, which the tests call too), or multiprocessing on the way."""
    root = Path(os.path.realpath(tmp_path))
    learners = root / "minipaged" / ALLOCATOR.name
    guard = {"root": f"{root}{os.sep}", "learners": {str(learners)}}

    def called_from(*files: Path):
        """What the hook says of a process started through a function of each file, the first outermost."""
        call = None
        for path in reversed(files):
            namespace = {"_starter": _starter, "guard": guard, "inner": call}
            body = "inner()" if call else "_starter(guard)"
            exec(compile(f"def call():\n    return {body}\n", str(path), "exec"), namespace)
            call = namespace["call"]
        return call()

    multiprocessing = Path(sysconfig.get_paths()["stdlib"], "multiprocessing", "popen_fork.py")
    assert called_from(learners) == f"minipaged/{ALLOCATOR.name}:2"
    assert called_from(learners, Path(subprocess.__file__)) == f"minipaged/{ALLOCATOR.name}:2"
    assert called_from(learners, root / "minipaged" / "serving" / "launcher.py") is None
    assert called_from(root / "tests" / "test_stage11_tensor_parallel.py") is None
    assert called_from(learners, multiprocessing, Path(subprocess.__file__)) is None


@pytest.fixture(scope="module")
def perfect(tmp_path_factory, clean_workspace):
    """The reference allocator graded with the teacher's tests, written with ``--format json``."""
    tmp = tmp_path_factory.mktemp("perfect")
    private = _teachers_tests(tmp / "private")
    written = tmp / "report.json"
    done = subprocess.run([*CLI, str(clean_workspace), "--stage", "1", "--tests", str(private), "--format", "json",
                           "--output", str(written)], capture_output=True, text=True)
    return {"done": done, "report": json.loads(written.read_text())}


def test_a_perfect_submission_scores_full_marks_on_what_this_machine_runs(perfect):
    report, done = perfect["report"], perfect["done"]
    assert done.returncode == 0, done.stderr
    (row,) = report["stages"]
    assert row["status"] == "complete" and row["failed"] == row["skipped"] == 0
    assert report["score"] == report["max_score"] == row["score"] == row["max_points"]
    assert row["points"] == report["points"] == RUBRIC.points[1]
    blocked = [t for t in row["tests"] if t["status"] == "blocked"]
    assert row["blocked"] == len(blocked) == (0 if torch.cuda.is_available() else 1)
    assert row["blocked_points"] == report["blocked_points"] == round(sum(t["points"] for t in blocked), 4)
    assert row["max_points"] == round(row["points"] - row["blocked_points"], 4)
    assert row["score"] == pytest.approx(sum(t["score"] for t in row["tests"]), abs=1e-3)


def test_the_text_report_gives_the_points_of_the_json_one(perfect):
    report, lines = perfect["report"], perfect["done"].stdout.splitlines()
    assert report["schema"] == SCHEMA and "execution_time" in report  # --format json wrote the whole report
    stages = [re.match(r"stage (\d+): ([\d.]+)/([\d.]+) points", line) for line in lines]
    assert [(int(m[1]), float(m[2]), float(m[3])) for m in stages if m] == [  # out of the stage's full points
        (row["stage"], row["score"], row["points"]) for row in report["stages"]]
    (total,) = [m for line in lines if (m := re.match(r"score: ([\d.]+)/([\d.]+) points", line))]
    assert (float(total[1]), float(total[2])) == (report["score"], report["points"])
    held = [float(m[1]) for line in lines
            if line.startswith("stage ") and (m := re.search(r"([\d.]+) held back", line))]
    assert held == [row["blocked_points"] for row in report["stages"] if row["blocked"]]


def _learners_source(reference: str) -> str:
    """What a learner's finished file looks like: the reference's code, its solution markers gone."""
    return "".join(line for line in reference.splitlines(keepends=True)
                   if not line.strip().startswith(("# BEGIN SOLUTION", "# END SOLUTION")))


@pytest.mark.parametrize("number", sorted(stage_files()))
def test_the_grader_hashes_the_files_the_learner_wrote_in_a_real_workspace(number, tmp_path):
    """A workspace made by ``exercise``, its stubs replaced by a learner's code (no markers left): the
    report hashes exactly the stage's files with solutions, as the learner left them."""
    from minipaged.learn.exercise import files_to_write
    from minipaged.learn.grade import graded_files

    expected = [path.name for path in files_to_write(number)]
    workspace = make_workspace(number, tmp_path / "ws")
    for name in expected:
        target = workspace / "minipaged" / name
        target.write_text(_learners_source((REPO_DIR / "minipaged" / name).read_text()) + "# mine\n")
    hashes = graded_files(workspace, [number])
    assert sorted(hashes) == sorted(f"minipaged/{name}" for name in expected) and expected
    for name in expected:
        assert hashes[f"minipaged/{name}"] == _digest(workspace / "minipaged" / name)
    assert [p.name for p in files_to_write(number, workspace / "minipaged")] == expected


def test_the_exercise_command_names_the_files_it_stubbed(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minipaged.cli", "exercise", "3", "--out", str(tmp_path / "ws")],
                         capture_output=True, text=True, check=True).stdout
    named = re.findall(r"minipaged/(stage\w+\.py)", out.splitlines()[0])
    assert named == ["stage3_copy_on_write.py"]


def test_each_stage_is_printed_as_soon_as_it_is_graded(clean_workspace):
    """Stages run one after the other; each one's line comes as it is graded, in order, before the report."""
    seen = []
    report = grade_report(clean_workspace, [0, 1], progress=lambda row: seen.append((row["stage"], row["status"])))
    assert seen == [(row["stage"], row["status"]) for row in report["stages"]] and [s for s, _ in seen] == [0, 1]
    done = subprocess.run([*CLI, str(clean_workspace), "--stage", "0", "--stage", "1"], capture_output=True, text=True)
    progress = [line for line in done.stderr.splitlines() if re.match(r"\d+ +\d+/\d+", line)]
    assert [int(line.split()[0]) for line in progress] == [0, 1]


def test_blocked_tests_show_beside_the_tests_that_ran():
    from minipaged.learn.grade import StageResult, format_row

    assert format_row(StageResult(5, 26, 0, 9, blocked=9)).split()[1:] == ["26/26", "(+9", "blocked)", "complete"]
    assert "blocked" not in format_row(StageResult(1, 3, 1, 0))


def test_the_grader_names_a_known_mistake_under_a_test_it_fails():
    """The known mistakes are the mutant catalogue's names, by the test that caught each first: the grade
    table names them under a failing test."""
    from minipaged.learn.grade import StageResult, format_grades, known_mistakes
    from minipaged.learn.mutants import recorded_killers

    mistakes = known_mistakes()
    expected: dict[str, list[str]] = {}
    for key, test in sorted(recorded_killers().items()):
        if "::" in test:
            expected.setdefault(test, []).append(key.split(": ", 1)[1])
    assert mistakes == expected and mistakes
    test, names = next(iter(mistakes.items()))
    text = format_grades([StageResult(0, 0, 1, 0, [test])])
    assert all(f"a known mistake that fails it: {name}" in text for name in names)
