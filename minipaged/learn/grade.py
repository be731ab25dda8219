"""Grading a workspace: points per test and per stage, what was graded, where, and shortcuts refused.

``grade_report(dir)`` builds a scratch folder from the grader's own copy of minipaged (the
package it runs from, its tests, ``conftest.py`` and ``pyproject.toml``), puts the learner's
stage files from ``dir`` in it, and a teacher's extra tests beside the public ones; it runs the
stage tests there, with the grader's own report plugin, and returns one JSON-ready dict: per
stage, per test, its points and outcome; the SHA-256 of the files the learner edits; the machine
and the versions; and the shortcuts that were refused. The learner's stage files are the only
code of theirs that runs; their folder is only read.

The rubric, ``RUBRIC``, is the one place that gives points: each stage's, shared among its
tests by weight. A test skipped because the machine lacks what it needs (a GPU, Triton, or a tool of
the toolchain) is *blocked*: its points are held back, neither earned nor lost, and leave the
maximum of this run; the stage is graded on what this machine can run.

A submission is *refused*, with a reason and no points, when the folder holds no exercise
marker, when a file the learner edits loads code by hand or reads the installed minipaged (it
must be the learner's own), when it reads the tests or the grader (or starts a process, or calls
C, whose reads no hook sees), or when the tests (or pytest's configuration, or the grader) differ
from the grader's own copy.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minipaged.learn.exercise import (
    ANSWER_FILES,
    CACHES,
    PACKAGE_DIR,
    REPO_DIR,
    STAGE_FILE,
    WORKSPACE_MARK,
    _digest,
    _workspace_files,
    edited_stage,
    files_to_write,
    grader_files,
    stage_files,
)

SCHEMA = "minipaged-grade/1"  # in every report and results.json it writes: a previous one may be replaced


@dataclass(frozen=True)
class Rubric:
    """How many points each stage is worth, and how its tests share them.

    A stage's points are shared by its tests in proportion to their weights; a test's weight is
    that of the first pattern (``fnmatch``, on the test's node id) it matches, else 1.

    A test the tests themselves skip (not the package's code) is *blocked* when its reason
    matches ``blocked`` (it needs a GPU) on a machine with none, or ``triton`` (it needs Triton)
    on a machine where Triton cannot be imported (it is built for Linux on x86-64 only), or
    ``tools`` (a tool of the toolchain this machine's build lacks, such as Triton's ``ptxas``) on
    any machine. What the machine has is read before any of the learner's code runs.
    """

    points: dict[int, float]
    weights: tuple[tuple[str, float], ...] = ()
    blocked: str = r"\b(CUDA|GPU)\b"
    tools: str = r"\bptxas\b"
    triton: str = r"\bTriton\b"

    def weight(self, nodeid: str) -> float:
        return next((w for pattern, w in self.weights if fnmatch.fnmatchcase(nodeid, pattern)), 1.0)

    def test_points(self, stage: int, nodeids: list[str]) -> dict[str, float]:
        """Each test's share of the stage's points."""
        total = sum(self.weight(n) for n in nodeids)
        worth = self.points.get(stage, 0.0)
        return {n: round(worth * self.weight(n) / total, 4) if total else 0.0 for n in nodeids}

    def as_dict(self) -> dict:
        return {"points": {str(s): p for s, p in sorted(self.points.items())},
                "weights": [{"match": pattern, "weight": w} for pattern, w in self.weights],
                "blocked": self.blocked, "tools": self.tools, "triton": self.triton,
                "total": sum(self.points.values())}


# Five points per star of the exercise's difficulty (docs/exercises/index.md): the one place
# that gives points. Every test of a stage is worth the same share of it.
RUBRIC = Rubric(points={0: 10, 1: 5, 2: 10, 3: 10, 4: 15, 5: 20, 6: 20, 7: 15, 8: 20, 9: 15, 10: 20,
                        11: 15, 12: 15, 13: 10, 14: 15, 15: 10})


@dataclass
class StageResult:
    stage: int
    passed: int
    failed: int
    skipped: int  # blocked tests among them
    failures: list[str] = field(default_factory=list)  # the failing tests, by node id
    reasons: dict[str, list[str]] = field(default_factory=dict)  # node id -> where and why it failed
    blocked: int = 0  # skipped for want of a GPU, Triton or a tool: their points held back

    @property
    def total(self) -> int:
        return self.passed + self.failed

    @property
    def status(self) -> str:
        if self.total == 0:
            return "blocked" if self.blocked else "no tests"
        if self.failed == 0:
            return "complete"
        return "not started" if self.passed == 0 else "in progress"


PLUGIN = "minipaged_grade_plugin"  # the name the grader loads its own pytest_report.py by


def run_tests(directory: Path, *pytest_args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """Run pytest in ``directory``; return ``{nodeid: {"outcome", "stages", "reason"?, "skipped_in"?}}``.

    The report is written by the grader's own plugin: this package's ``pytest_report.py``, copied
    out of ``directory`` and loaded as ``PLUGIN``, never a copy ``directory`` holds."""
    with tempfile.TemporaryDirectory() as tmp:
        plugin = Path(tmp) / "plugin"
        plugin.mkdir()
        shutil.copy2(Path(__file__).with_name("pytest_report.py"), plugin / f"{PLUGIN}.py")
        report = Path(tmp) / "report.json"
        env = {**os.environ, **(env or {}), "MINIPAGED_REPORT": str(report)}
        env["PYTHONPATH"] = os.pathsep.join([str(plugin), *filter(None, [env.get("PYTHONPATH")])])
        env.pop("PYTEST_ADDOPTS", None)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbmake",
                   "-p", PLUGIN, *pytest_args]  # no stage test runs a notebook
        subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report in {directory}: is it a workspace?")
        return json.loads(report.read_text())


# --- shortcuts -------------------------------------------------------------------------------

LOADERS = {"importlib", "imp", "runpy", "pkgutil", "zipimport", "site"}  # modules that load code by hand
TEST_MODULES = {"pytest", "_pytest", "unittest", "conftest", "tests"}  # what the tests are made of
TEST_PREFIXES = ("test_", "helpers_")
FRAMES = {"inspect", "gc"}  # a caller's frames hold the test's expected values
# A process, or C code, that the file starts itself: what it reads, no hook of the grader sees.
PROCESSES = {"subprocess", "_posixsubprocess", "pty", "ctypes", "_ctypes"}
PROCESS_CALLS = {"os": re.compile(r"system|popen|fork|forkpty|exec\w*|spawn\w*|posix_spawnp?"),
                 "asyncio": re.compile(r"create_subprocess_\w+")}
LOADING_CALLS = {"__import__", "exec", "eval", "compile"}
IMPORT_STATE = {"path", "modules", "meta_path", "path_hooks", "path_importer_cache"}
LOCATING = {"__file__", "__path__", "__spec__", "__loader__"}
INSTALLED = re.compile(r"(site|dist)-packages")
TEST_PATH = re.compile(r"(^|[\\/])tests([\\/]|$)|test_stage\d|conftest")
PROTECTED_NAMES = ("conftest.py", "pyproject.toml", "pytest.ini", "tox.ini", "setup.cfg", "sitecustomize.py",
                   "usercustomize.py")
GRADER = re.compile(rf"^(minipaged\.learn|{PLUGIN})(\.|$)")  # the grader's modules, its report plugin among them


def _refusal(rule: str, where: str, reason: str) -> dict:
    return {"rule": rule, "where": where, "reason": reason}


def scan_source(source: str, filename: str) -> list[dict]:
    """The shortcuts a learner's file takes, found in its code (docstrings and comments left out).

    ``reference``: it loads code by hand or locates a package's files (the installed minipaged);
    ``reads-tests``: it imports the tests, pytest, unittest or the grader, names a test's file,
    reads its callers' frames, or starts a process or calls C (``subprocess``, ``os.system``,
    ``ctypes``), whose reads the grader cannot watch; multiprocessing, whose children run the
    file's own Python, is allowed (stage 11's workers).
    """
    tree = ast.parse(source, filename)
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    modules: dict[str, str] = {}  # the names its imports bind to a module: ``import os as o`` binds o to os
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules.update((a.asname, a.name) if a.asname else (a.name.split(".")[0],) * 2 for a in n.names)
    found = []

    def add(node: ast.AST, rule: str, reason: str) -> None:
        found.append(_refusal(rule, f"{filename}:{getattr(node, 'lineno', 0)}", reason))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names if not (isinstance(node, ast.ImportFrom) and node.level) else []:
                root = name.split(".")[0]
                if root in LOADERS:
                    add(node, "reference", f"imports {name}: it loads code by hand, the installed minipaged too")
                elif root in TEST_MODULES or root.startswith(TEST_PREFIXES):
                    add(node, "reads-tests", f"imports {name}: the tests are not the learner's to read")
                elif root in FRAMES:
                    add(node, "reads-tests", f"imports {name}: its callers' frames hold the tests' expected values")
                elif root in PROCESSES:
                    add(node, "reads-tests", f"imports {name}: what a process or C code reads, the grader cannot watch")
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in PROCESS_CALLS:
                for alias in node.names:
                    if PROCESS_CALLS[node.module].fullmatch(alias.name):
                        add(node, "reads-tests", f"imports {node.module}.{alias.name}: it starts a process, "
                                                 "whose reads the grader cannot watch")
            if isinstance(node, ast.ImportFrom):  # a learner's file is in minipaged/: ``from . import learn``
                package = ".".join(filter(None, ["minipaged" if node.level else "", node.module or ""]))
                names = [package, *(f"{package}.{alias.name}" for alias in node.names)]
            grader = next((name for name in names if GRADER.match(name)), None)
            if grader:
                add(node, "reads-tests", f"imports {grader}: the grader is not the learner's to read")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LOADING_CALLS:
            add(node, "reference", f"calls {node.func.id}(): it runs code that is not in the file")
        elif isinstance(node, ast.Attribute):
            bound = node.value.id if isinstance(node.value, ast.Name) else None
            base = modules.get(bound, bound) if bound else None
            if base in PROCESS_CALLS and PROCESS_CALLS[base].fullmatch(node.attr):
                add(node, "reads-tests", f"uses {base}.{node.attr}: it starts a process, whose reads the grader "
                                         "cannot watch")
            elif base == "sys" and node.attr in IMPORT_STATE:
                add(node, "reference", f"uses sys.{node.attr}: it changes where modules come from")
            elif base == "sys" and node.attr == "_getframe":
                add(node, "reads-tests", "reads its callers' frames: they hold the tests' expected values")
            elif node.attr in LOCATING and bound is not None:
                add(node, "reference", f"reads {bound}.{node.attr}: it locates a package's files")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if INSTALLED.search(node.value):
                add(node, "reference", f"names {node.value!r}: the installed packages")
            elif TEST_PATH.search(node.value) or node.value == "tests":
                add(node, "reads-tests", f"names {node.value!r}: the tests' files")
    return found


def _protected(name: str) -> bool:
    """The files that decide the grade: the tests, pytest's configuration, the grader itself."""
    return (name.startswith(("tests/", "minipaged/learn/")) or name.rsplit("/", 1)[-1] in PROTECTED_NAMES
            or name.endswith(".pth"))


def _stage_names() -> list[str]:
    """The names of the grader's stage files: the files of a workspace that are the learner's."""
    return [path.name for paths in stage_files(PACKAGE_DIR).values() for path in paths]


def integrity(directory: Path, stages: list[int]) -> tuple[list[dict], dict]:
    """The shortcuts found before any test runs, and what was checked.

    The folder must hold the exercise marker and every stage file. Its tests, pytest's
    configuration and the grader (``minipaged/learn/``) are compared with the grader's own copy
    (``grader_files``), never with a list the folder holds: any file edited, added or deleted is
    refused. The learner's files are read for shortcuts: the graded stages' files, and every other
    stage file that differs from the grader's. Any other file of the package that differs from the
    grader's is listed as not run: the tests run the grader's."""
    directory = Path(directory)
    refused = []
    if not (directory / WORKSPACE_MARK).is_file():
        refused.append(_refusal("not-a-workspace", WORKSPACE_MARK,
                                "no exercise marker: `minipaged exercise` did not write this folder"))
    expected = grader_files(REPO_DIR)
    present = _workspace_files(directory)
    for name in sorted(set(expected) | {name for name in present if _protected(name)}):
        if name not in present:
            refused.append(_refusal("tests-edited", name, f"{name} was deleted"))
        elif name not in expected:
            refused.append(_refusal("tests-edited", name, f"{name} was added"))
        elif _digest(present[name]) != _digest(expected[name]):
            refused.append(_refusal("tests-edited", name, f"{name} was edited: it differs from the grader's"))
    mine = {f"minipaged/{name}" for name in _stage_names()}
    for name in sorted(mine - set(present)):
        refused.append(_refusal("not-a-workspace", name, f"{name} is missing"))

    def edited(name: str) -> bool:
        return not (REPO_DIR / name).is_file() or _digest(REPO_DIR / name) != _digest(present[name])

    graded = {f"minipaged/{path.name}" for s in stages for path in stage_files(PACKAGE_DIR).get(s, [])}
    learners = {name for name in mine & set(present) if name in graded or edited(name)}
    for name in sorted(learners):
        refused.extend(scan_source((directory / name).read_text(), name))
    not_run = sorted(name for name in present if name.startswith("minipaged/") and name not in mine
                     and not _protected(name) and edited(name))
    checked = {"against": str(REPO_DIR), "tests_unchanged": not any(r["rule"] == "tests-edited" for r in refused),
               "files_read": sorted(learners), "not_run": not_run}
    return refused, checked


# --- the run ---------------------------------------------------------------------------------

def _harness(directory: Path, extra: Path | None, into: Path) -> list[str]:
    """Build the scratch copy in ``into``: the grader's package (its answer files left out), tests,
    ``conftest.py`` and ``pyproject.toml``; the learner's stage files from ``directory``; a
    teacher's tests in its ``tests/``. Return the teacher's test files as ``tests/...`` names. A
    teacher's file never replaces a public one."""
    skip = shutil.ignore_patterns(*CACHES, "*.pyc", *ANSWER_FILES)

    def ignore(folder: str, names: list[str]) -> set[str]:
        stages = {name for name in names if STAGE_FILE.match(name)} if Path(folder) == PACKAGE_DIR else set()
        return set(skip(folder, names)) | stages  # never the grader's solutions

    shutil.copytree(PACKAGE_DIR, into / "minipaged", ignore=ignore)
    for name, path in grader_files(REPO_DIR).items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, into / name)
    for name in _stage_names():
        if (directory / "minipaged" / name).is_file():
            shutil.copy2(directory / "minipaged" / name, into / "minipaged" / name)
    (into / WORKSPACE_MARK).write_text("workspace\n")  # the tests draw the same examples as in a workspace
    names = []
    for name, path in (_workspace_files(extra) if extra else {}).items():
        target = into / "tests" / name
        if target.exists():
            raise ValueError(f"{path} has the name of one of the workspace's tests (tests/{name}): rename it")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        names.append(f"tests/{name}")
    return names


def _outcome(record: dict, rubric: Rubric, machine: dict) -> str:
    """A test's status: its outcome, or ``blocked`` for a skip of the tests' own (not raised through
    the package's code) that names a GPU, on a machine without one, Triton, on a machine where it
    cannot be imported, or a tool of the toolchain. ``machine``: the report's environment."""
    reasons = record.get("reason", [])
    if record["outcome"] != "skipped" or record.get("skipped_in"):
        return record["outcome"]
    lacks = [rubric.tools, *([] if machine.get("gpus") else [rubric.blocked]),
             *([] if machine.get("triton") else [rubric.triton])]
    return "blocked" if any(re.search(pattern, r) for pattern in lacks for r in reasons) else record["outcome"]


def graded_files(directory: Path, stages: list[int]) -> dict[str, str]:
    """The SHA-256 of each file the learner edits in the graded stages, by relative path."""
    found = {}
    for stage in stages:
        if stage in stage_files(Path(directory) / "minipaged"):
            for path in files_to_write(stage, Path(directory) / "minipaged"):
                found[path.relative_to(directory).as_posix()] = _digest(path)
    return found


def grade_report(directory: Path, stages: list[int] | None = None, extra_tests: Path | None = None,
                 rubric: Rubric = RUBRIC, collect_only: bool = False,
                 progress: Callable[[dict], None] | None = None) -> dict:
    """Grade the workspace ``directory`` (every stage, or ``stages``), with a teacher's
    ``extra_tests`` beside its own; see the module's docstring. ``collect_only``: list the
    tests and their points, run none. The stages run one after the other; ``progress`` is
    given each stage's row (as in ``report["stages"]``, scored) as soon as it is graded."""
    directory = Path(directory).resolve()
    if not (directory / "minipaged").is_dir():
        raise FileNotFoundError(f"{directory} holds no minipaged package: is it a workspace?")
    if extra_tests is not None and not Path(extra_tests).is_dir():
        raise FileNotFoundError(f"no folder of tests at {extra_tests}")
    selected = sorted(stages) if stages else sorted(stage_files(PACKAGE_DIR))
    started = time.monotonic()
    refused, checked = integrity(directory, selected)
    report: dict = {"schema": SCHEMA, "directory": str(directory), "workspace_stage": edited_stage(directory),
                    "stages": [], "files": graded_files(directory, selected), "extra_tests": {},
                    "refused": refused, "checked": checked, "environment": {}, "rubric": rubric.as_dict()}
    if not refused or collect_only:
        with tempfile.TemporaryDirectory(prefix="minipaged-grade-") as tmp:
            root = Path(tmp)
            extra_names = _harness(directory, Path(extra_tests) if extra_tests else None, root)
            report["extra_tests"] = {name: _digest(root / name) for name in extra_names}
            reference = PACKAGE_DIR if PACKAGE_DIR.resolve() != (directory / "minipaged") else None
            guard = {"package": str(root / "minipaged"), "tests": str(root / "tests"),
                     "reference": str(reference) if reference else None, "out": str(root / "guard.json"),
                     "learners": [str(root / "minipaged" / name) for name in _stage_names()]}
            groups = [selected] if collect_only else [[stage] for stage in selected]  # one run per stage
            for group in groups:
                args = ["-m", " or ".join(f"stage{n}" for n in group), *(["--collect-only"] if collect_only else [])]
                records = run_tests(root, *args, env={"MINIPAGED_GUARD": json.dumps(guard)})
                seen = json.loads((root / "guard.json").read_text()) if (root / "guard.json").is_file() else {}
                report["environment"] = seen.get("environment", {}) or report["environment"]
                if not collect_only:
                    refused.extend(f for f in seen.get("findings", []) if f not in refused)
                graded = _stages(records, group, rubric, set(extra_names), report["environment"], collect_only)
                report["stages"].extend(graded)
                if progress is not None:
                    for row in graded:
                        progress(_scored_row(row, rubric, bool(refused)))
    _score(report, selected, rubric)
    report["execution_time"] = round(time.monotonic() - started, 1)
    return report


def _stages(records: dict[str, dict], selected: list[int], rubric: Rubric, extra: set[str], environment: dict,
            collect_only: bool) -> list[dict]:
    rows = []
    for stage in selected:
        ids = [nodeid for nodeid, record in records.items() if stage in record["stages"]]
        points = rubric.test_points(stage, ids)
        tests = []
        for nodeid in ids:
            record = records[nodeid]
            status = "collected" if collect_only else _outcome(record, rubric, environment)
            tests.append({"id": nodeid, "source": "extra" if nodeid.split("::")[0] in extra else "public",
                          "status": status, "weight": rubric.weight(nodeid), "points": points[nodeid],
                          "score": points[nodeid] if status == "passed" else 0.0,
                          **({"reason": record["reason"]} if record.get("reason") and not collect_only else {}),
                          **({"skipped_in": record["skipped_in"]} if record.get("skipped_in") else {})})
        rows.append({"stage": stage, "tests": tests})
    return rows


def _scored_row(row: dict, rubric: Rubric, refused: bool) -> dict:
    """A stage's row with its counts, status and points (see ``_score``)."""
    tests, stage = row["tests"], row["stage"]
    counts = {s: sum(t["status"] == s for t in tests) for s in ("passed", "failed", "skipped", "blocked")}
    worth = rubric.points.get(stage, 0.0)
    if refused:
        status = "refused"
        for test in tests:
            test["score"] = 0.0
    elif not tests or all(t["status"] == "collected" for t in tests):
        status = "no tests" if not tests else "collected"
    elif counts["failed"] + counts["skipped"] == 0:
        status = "complete" if counts["passed"] else "blocked"
    else:
        status = "not started" if counts["passed"] == 0 else "in progress"
    weights = {s: sum(t["weight"] for t in tests if t["status"] == s) for s in ("passed", "blocked")}
    total = sum(t["weight"] for t in tests)
    earned, blocked = (worth * weights[s] / total if total else 0.0 for s in ("passed", "blocked"))
    earned = 0.0 if refused else earned
    row.update({"points": worth, "max_points": round(worth - blocked, 4), "blocked_points": round(blocked, 4),
                "score": round(earned, 4), "status": status, **counts})
    return row


def _score(report: dict, selected: list[int], rubric: Rubric) -> None:
    """Each stage's score and status, and the total; a refused submission scores nothing.

    ``points``: the stage's in the rubric; ``blocked_points``: its blocked tests' share, held back;
    ``max_points``: the rest, what this machine could award; ``score``: the passed tests' share."""
    refused = bool(report["refused"])
    by_stage = {row["stage"]: row for row in report["stages"]}
    for stage in selected:
        _scored_row(by_stage.setdefault(stage, {"stage": stage, "tests": []}), rubric, refused)
    report["stages"] = [by_stage[s] for s in selected]
    report["score"] = round(sum(row["score"] for row in report["stages"]), 4)
    report["max_score"] = round(sum(row["max_points"] for row in report["stages"]), 4)
    report["points"] = round(sum(row["points"] for row in report["stages"]), 4)
    report["blocked_points"] = round(sum(row["blocked_points"] for row in report["stages"]), 4)


# --- what it prints and writes ---------------------------------------------------------------

def exit_status(report: dict) -> int:
    """``minipaged grade``'s exit status: 0 when nothing was refused, every graded stage is complete
    or blocked (its points held back, to grade again where its tests run) and one at least is
    complete; 1 otherwise. A stage with no tests is not done: its points are in the maximum."""
    stages = [row["status"] for row in report["stages"]]
    done = not report["refused"] and all(s in ("complete", "blocked") for s in stages)
    return 0 if done and "complete" in stages else 1


def rows(report: dict) -> list[StageResult]:
    """The report as the grade table's rows (blocked tests count as skipped)."""
    found = []
    for row in report["stages"]:
        failed = [t for t in row["tests"] if t["status"] == "failed"]
        found.append(StageResult(row["stage"], row["passed"], row["failed"], row["skipped"] + row["blocked"],
                                 [t["id"] for t in failed], {t["id"]: t.get("reason", []) for t in failed},
                                 row["blocked"]))
    return found


def grade(directory: Path, stages: list[int] | None = None) -> list[StageResult]:
    """Run the stage tests in ``directory`` (every stage, or ``stages``); count passes per stage."""
    return [row for row in rows(grade_report(directory, stages)) if row.total or row.skipped]


def format_grades(rows: list[StageResult], edited: int | None = None, show: int = 5) -> str:
    """The grade table, one row per stage, and the likely cause.

    Under each stage, its first ``show`` failing tests, each with the line of the test where
    it failed and the first line of the error.

    ``edited``: the stage the learner works on. When another stage fails too, the lowest
    failing stage is named as the likely cause: every stage builds on the ones below it.
    """
    lines = [f"{'stage':<6} {'passed':>10}  status", "-" * 32]
    mistakes = known_mistakes()
    for row in rows:
        lines.append(format_row(row))
        for nodeid in row.failures[:show]:
            lines.append(f"{'':<8}failed: {nodeid}")
            lines.extend(f"{'':<10}{reason}" for reason in row.reasons.get(nodeid, []))
            lines.extend(f"{'':<10}a known mistake that fails it: {name}" for name in mistakes.get(nodeid, []))
        if len(row.failures) > show:
            lines.append(f"{'':<8}... and {len(row.failures) - show} more")
    failing = [row.stage for row in rows if row.failures]
    if failing and edited is not None and any(stage != edited for stage in failing):
        lowest = min(failing)
        cause = "your stage" if lowest == edited else "a stage below yours, which you did not edit"
        lines.append(f"likely cause: stage {lowest} ({cause}); every stage builds on the ones below it, "
                     f"so fix the lowest failing stage first")
    return "\n".join(lines)


def format_row(row: StageResult) -> str:
    """A stage's line of the grade table: its passed tests out of those that ran, its blocked ones beside."""
    blocked = f" (+{row.blocked} blocked)" if row.blocked else ""
    return f"{row.stage:<6} {f'{row.passed}/{row.total}':>10}{blocked}  {row.status}"


KNOWN_MISTAKES_FILE = Path(__file__).with_name("known_mistakes.json")


def known_mistakes(path: Path = KNOWN_MISTAKES_FILE) -> dict[str, list[str]]:
    """For each test, the plausible mistakes (the mutant catalogue's, by name) it was seen to catch first:
    what a failure of it most likely means. Names only: they describe the mistake, never the solution."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _points(x: float) -> str:
    """Points as the report gives them (four decimals at most), without trailing zeros."""
    return f"{x:.4f}".rstrip("0").rstrip(".")


def format_report(report: dict) -> str:
    """The grade table, then the points out of what this machine can award, what is held back
    for blocked tests, and any refusal."""
    lines = [format_grades(rows(report), report["workspace_stage"])] if not report["refused"] else []
    for row in report["stages"]:
        held = (f" ({_points(row['blocked_points'])} held back: {row['blocked']} tests blocked, for want of a GPU, "
                "Triton or a tool here)") if row["blocked"] else ""
        lines.append(f"stage {row['stage']}: {_points(row['score'])}/{_points(row['points'])} points{held}")
    held = f" ({_points(report['blocked_points'])} held back: grade again where the blocked tests run)" \
        if report["blocked_points"] else ""
    lines.append(f"score: {_points(report['score'])}/{_points(report['points'])} points{held}")
    if report["refused"]:
        lines.append("refused, no points:")
        lines.extend(f"  {r['where']}: {r['reason']}" for r in report["refused"])
    if report["checked"].get("not_run"):
        lines.append("not run (the grader's copy ran instead): " + ", ".join(report["checked"]["not_run"]))
    return "\n".join(lines)


def format_rubric(report: dict) -> str:
    """The rubric: each stage's points, and each test's share as collected in the workspace."""
    rubric = report["rubric"]
    lines = [f"rubric: {_points(rubric['total'])} points; tests skipped for want of a GPU (reason matching "
             f"{rubric['blocked']!r}), of Triton ({rubric['triton']!r}) or of a tool ({rubric['tools']!r}) "
             "are blocked: held back, not failed"]
    lines.extend(f"  weight {w['weight']:g}: {w['match']}" for w in report["rubric"]["weights"])
    for row in report["stages"]:
        lines.append(f"stage {row['stage']}: {_points(row['points'])} points, {len(row['tests'])} tests")
        lines.extend(f"  {_points(t['points']):>7}  {t['id']}" + (" (extra)" if t["source"] == "extra" else "")
                     for t in row["tests"])
    return "\n".join(lines)


def gradescope_results(report: dict, hidden: str = "after_published") -> dict:
    """The report as Gradescope's ``results.json``: one entry per test, with its points.

    A blocked test is 0 of 0 here (its points are held back, not lost, and out of the maximum) and
    has no ``status``: Gradescope knows only ``passed`` and ``failed``, and it is neither; its
    output and its tags say blocked. A teacher's extra tests are shown with ``hidden`` visibility,
    the public ones at once. The top-level ``score`` is the report's, out of its ``max_score``."""
    tests = []
    for row in report["stages"]:
        for number, test in enumerate(row["tests"], start=1):
            blocked = test["status"] == "blocked"
            output = "\n".join(test.get("reason", []))
            if blocked:
                output = (f"blocked: needs a GPU, Triton or a tool this machine lacks; its {_points(test['points'])} "
                          "points are held back, out of the maximum")
            entry = {"name": test["id"], "number": f"{row['stage']}.{number}",
                     "score": 0.0 if blocked else test["score"], "max_score": 0.0 if blocked else test["points"],
                     "output": output, "tags": [f"stage{row['stage']}", test["source"], test["status"]],
                     "visibility": hidden if test["source"] == "extra" else "visible"}
            if not blocked:
                entry["status"] = "passed" if test["status"] == "passed" else "failed"
            tests.append(entry)
    summary = format_report(report)
    return {"score": report["score"], "execution_time": report["execution_time"], "output": summary,
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests,
            "extra_data": {"schema": SCHEMA, **{key: report[key] for key in (
                "max_score", "points", "blocked_points", "refused", "files", "extra_tests", "environment")}}}


def is_previous_results(path: Path) -> bool:
    """Whether ``path`` is a file this grader wrote (a report or a results.json): one it may replace."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and SCHEMA in (data.get("schema"), (data.get("extra_data") or {}).get("schema"))


def write_results(path: Path, data: dict, force: bool = False) -> Path:
    """Write ``data`` as JSON to ``path``: a new file, or one this grader wrote before; anything
    else only with ``force``. Never a folder."""
    path = Path(path)
    if path.is_dir():
        raise FileExistsError(f"{path} is a folder; --output names the file to write")
    if path.exists() and not force and not is_previous_results(path):
        raise FileExistsError(f"{path} exists and is not results this grader wrote; pass --force to replace "
                              "it, or choose another --output")
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(data, indent=2) + "\n")
    scratch.replace(path)
    return path
