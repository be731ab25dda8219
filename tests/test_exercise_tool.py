"""The exercise tool, and the two promises it makes for every stage of the ladder.

1. The stubs of stage N fail every stage-N test (no test passes without the learner's code).
2. The tests of the stages below N still pass with stage N stubbed. This one is proved
   statically: no stage module below N, and no test of a stage below N, imports stage N.

Test ids here never contain ``stage<N>``, so that ``pytest -k stageN`` never selects them.
"""

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import minipaged
from minipaged.learn.exercise import (
    REPO_DIR,
    WORKSPACE_MARK,
    SolutionMarkerError,
    edited_stage,
    files_to_write,
    make_workspace,
    solution_regions,
    stage_files,
    stub_source,
    tutorial_for,
    workspace_changes,
    workspace_notebook,
)
from minipaged.learn.grade import StageResult, format_grades, run_tests

pytestmark = pytest.mark.tooling

STAGES = sorted(stage_files())
STAGE_MODULE = re.compile(r"minipaged\.stage(\d+)_")
# Every file of every stage, with an id that never contains ``stage<N>``: "6-swapping".
FILES = [(stage, path) for stage, paths in stage_files().items() for path in paths]
FILE_IDS = [f"{stage}-{path.stem.split('_', 1)[1]}" for stage, path in FILES]


def test_every_stage_has_its_tests_tutorial_and_docs_page():
    assert STAGES == list(range(len(STAGES))), "stages must be numbered 0, 1, 2, ... without gaps"
    for stage, paths in stage_files().items():
        main = paths[0]
        topic = main.stem.split("_", 1)[1]
        assert list((REPO_DIR / "tests").glob(f"test_stage{stage}_*.py")), f"no tests for {main.name}"
        assert list((REPO_DIR / "tutorials").glob(f"{stage:02d}_*.ipynb")), f"no tutorial for {main.name}"
        assert (REPO_DIR / "docs" / "stages" / f"{stage}_{topic}.md").exists(), f"no docs page for {main.name}"
        # the main file may be all given (stage 7's engine loop); the stage has something to write
        assert any(solution_regions(path.read_text(), str(path)) for path in paths), f"stage {stage}: no solution"
        for path in paths[1:]:  # something to write, or only messages to read (stage 10's scheduler output)
            assert solution_regions(path.read_text(), str(path)) or only_dataclasses(path), path.name


def only_dataclasses(path: Path) -> bool:
    """Whether every top-level class of a file is a dataclass and it defines no function of its own."""
    tree = ast.parse(path.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    return bool(classes) and not any(isinstance(n, ast.FunctionDef) for n in tree.body) and all(
        any("dataclass" in ast.unparse(d) for d in c.decorator_list) for c in classes)


def test_a_stage_of_two_files_names_its_main_file_first():
    """The main file imports the stage's other files; its topic names the tutorial and the docs page."""
    names = {stage: [path.name for path in paths] for stage, paths in stage_files().items()}
    assert names[6] == ["stage6_scheduler.py", "stage6_swapping.py"]
    assert names[7] == ["stage7_engine.py", "stage7_model_runner.py"]
    assert names[10] == ["stage10_v1_scheduler.py",  # it imports its KV cache manager and the messages; async,
                         "stage10_async_scheduling.py", "stage10_engine_core.py",  # the engine and the front end
                         "stage10_front_end.py", "stage10_kv_cache_manager.py",  # import it
                         "stage10_model_runner.py", "stage10_sched_output.py"]
    assert names[11] == ["stage11_tensor_parallel.py", "stage11_worker.py"]  # the driver imports its workers
    assert names[12] == ["stage12_speculative.py", "stage12_rejection_sampler.py"]  # the engine, its proposer
    assert names[14] == ["stage14_disaggregated_prefill.py", "stage14_kv_connector.py"]  # the engine, its connector
    assert names[15] == ["stage15_hybrid_kv_cache.py", "stage15_kv_cache_groups.py"]  # the manager, its groups
    assert all(len(paths) == 1 for stage, paths in names.items() if stage not in (6, 7, 10, 11, 12, 14, 15))
    assert tutorial_for(10) == "tutorials/10_v1_scheduler.ipynb" and tutorial_for(7) == "tutorials/07_engine.ipynb"
    assert tutorial_for(12) == "tutorials/12_speculative.ipynb"


@pytest.mark.parametrize(
    "source,message",
    [
        ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    pass\n", "x.py:3: nested"),
        ("def f():\n    pass\n    # END SOLUTION\n", "x.py:3: '# END SOLUTION' without"),
        ("def f():\n    # BEGIN SOLUTION\n    pass\n", "x.py:2: '# BEGIN SOLUTION' is never closed"),
        ("# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n", "x.py:1: .* must be inside a function"),
    ],
    ids=["nested", "end-without-begin", "never-closed", "not-in-a-function"],
)
def test_bad_markers_are_errors_naming_file_and_line(source, message):
    with pytest.raises(SolutionMarkerError, match=message):
        stub_source(source, 0, "tutorials/00_x.ipynb", "x.py")


def test_stubs_keep_signatures_and_docstrings():
    source = (
        "def area(w: int, h: int = 2) -> int:\n"
        '    """Width times height."""\n'
        "    # BEGIN SOLUTION multiply the sides\n"
        "    return w * h\n"
        "    # END SOLUTION\n"
    )
    stubbed = stub_source(source, 3, "tutorials/03_cow.ipynb")
    namespace = {}
    exec(stubbed, namespace)
    area = namespace["area"]
    assert area.__doc__ == "Width times height." and area.__annotations__["return"] is int
    with pytest.raises(NotImplementedError, match=r"stage 3: multiply the sides — see tutorials/03_cow.ipynb"):
        area(2)


def top_level_names(source: str) -> set[str]:
    """The names a module's own statements define at its top level: defs, classes, assignments, imports."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("number,path", FILES, ids=FILE_IDS)
def test_stub_modules_import_and_keep_the_public_names(number, path, tmp_path, monkeypatch):
    original = importlib.import_module(f"minipaged.{path.stem}")
    stubbed = tmp_path / path.name
    stubbed.write_text(stub_source(path.read_text(), number, "t.ipynb", str(path)))
    spec = importlib.util.spec_from_file_location(f"stubbed_{path.stem}", stubbed)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    public = {n for n in top_level_names(path.read_text()) if not n.startswith("_")}  # not dir(original): Triton's
    assert public and public <= set(dir(module)) and public <= set(dir(original))  # interpreter adds its own there


@pytest.mark.parametrize("number", STAGES)
def test_stubs_fail_every_test_of_their_own_rung(number, tmp_path):
    workspace = make_workspace(number, tmp_path / "ws")
    results = run_tests(workspace, "-k", f"stage{number}")
    ran = {k: v for k, v in results.items() if v["outcome"] != "skipped"}
    assert ran, "no test of this stage ran in the workspace"
    passed = [k for k, v in ran.items() if v["outcome"] == "passed"]
    assert not passed, f"these tests pass without the learner's code: {passed}"
    assert all(number in v["stages"] for v in results.values()), "-k selected foreign tests"
    assert all("test_exercise_tool" not in k for k in results)
    readme = (workspace / "README.md").read_text()
    for path in files_to_write(number):  # every file of the stage with a solution is stubbed, and named
        assert "NotImplementedError(" in (workspace / "minipaged" / path.name).read_text(), path.name
        assert f"`minipaged/{path.name}`" in readme, path.name


def _stages_imported(path: Path) -> set[int]:
    """The stage numbers a file imports, directly or through names of the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if m := STAGE_MODULE.match(node.module + "_"):
                found.add(int(m.group(1)))
            elif node.module == "minipaged":
                for alias in node.names:
                    if hasattr(minipaged, alias.name):  # a name the package exports
                        target = getattr(minipaged, alias.name)
                    else:  # a submodule not imported yet: ``from minipaged import stage10_v1_scheduler``
                        target = importlib.import_module(f"minipaged.{alias.name}")
                    owner = target.__name__ if inspect.ismodule(target) else getattr(target, "__module__", "")
                    if m := STAGE_MODULE.match(owner + "_"):
                        found.add(int(m.group(1)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if m := STAGE_MODULE.match(alias.name + "_"):
                    found.add(int(m.group(1)))
    return found


@pytest.mark.parametrize("number", STAGES)
def test_lower_rungs_never_import_this_one(number):
    """With stage N stubbed, lower stages and their tests still pass: they cannot reach it.
    A stage's files may import one another, never a file of a higher stage."""
    for lower in range(number):
        for module in stage_files()[lower]:
            assert max(_stages_imported(module), default=-1) <= lower, f"{module.name} imports upward"
        for test in (REPO_DIR / "tests").glob(f"test_stage{lower}_*.py"):
            assert number not in _stages_imported(test), f"{test.name} imports stage {number}"
    for own in stage_files()[number]:
        assert max(_stages_imported(own), default=-1) <= number, f"{own.name} imports upward"
        assert f"minipaged.{own.stem}" not in _module_names_imported(own), f"{own.name} imports itself"


def _module_names_imported(path: Path) -> set[str]:
    return {node.module for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module}


def test_keyword_selection_never_picks_this_file():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", "stage0"],
        cwd=REPO_DIR, capture_output=True, text=True, check=True,
    ).stdout
    assert "test_stage0_" in out and "test_exercise_tool" not in out


def test_workspace_refuses_to_overwrite_and_rejects_unknown_stages(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "mine.py").write_text("my work")
    with pytest.raises(FileExistsError, match="--force"):
        make_workspace(0, tmp_path / "ws")
    with pytest.raises(ValueError, match="no stage 99; stages available"):
        make_workspace(99, tmp_path / "other")


def test_force_replaces_only_a_workspace_it_wrote(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "mine.py").write_text("my work")
    with pytest.raises(FileExistsError):
        make_workspace(0, tmp_path / "ws", force=True)  # a folder of the user's: left alone
    assert (tmp_path / "ws" / "mine.py").read_text() == "my work"
    with pytest.raises(FileExistsError):
        make_workspace(0, REPO_DIR, force=True)  # the checkout itself
    assert (REPO_DIR / "minipaged" / "stage0_contiguous.py").exists()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_force_replaces_a_clean_workspace_and_refuses_one_that_holds_the_learners_work(tmp_path):
    cli = [sys.executable, "-m", "minipaged.cli", "exercise"]
    workspace = make_workspace(1, tmp_path / "ex")
    (workspace / "minipaged" / "__pycache__").mkdir(exist_ok=True)  # caches are no one's work
    (workspace / "minipaged" / "__pycache__" / "stage1_block_allocator.cpython-311.pyc").write_bytes(b"x")
    (workspace / ".hypothesis" / "examples").mkdir(parents=True)
    (workspace / ".hypothesis" / "examples" / "a").write_text("cache")
    (workspace / ".pytest_cache").mkdir()
    (workspace / ".pytest_cache" / "README.md").write_text("cache")
    done = subprocess.run([*cli, "2", "--out", str(workspace), "--force"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # as written: replaced, by another stage even
    assert edited_stage(workspace) == 2
    assert "NotImplementedError" in (workspace / "minipaged" / "stage2_block_table.py").read_text()
    assert "NotImplementedError" not in (workspace / "minipaged" / "stage1_block_allocator.py").read_text()

    stub = workspace / "minipaged" / "stage2_block_table.py"
    written = stub.read_text()
    stub.write_text(written.replace("raise NotImplementedError(", "pass  # (", 1))
    (workspace / "notes.md").write_text("my notes")
    before = _files(workspace)
    refused = subprocess.run([*cli, "1", "--out", str(workspace), "--force"], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "stage2_block_table.py" in refused.stderr and "notes.md" in refused.stderr  # what it keeps
    assert _files(workspace) == before, "--force changed a workspace holding the learner's work"
    for edit, names in [(lambda: None, ["minipaged/stage2_block_table.py (edited)", "notes.md (added)"]),
                        (lambda: stub.write_text(written), ["notes.md (added)"])]:  # notes alone count
        edit()
        before = _files(workspace)
        for stage in (2, 1):
            with pytest.raises(FileExistsError):
                make_workspace(stage, workspace, force=True)
            assert sorted(workspace_changes(workspace)) == names
            assert _files(workspace) == before, "--force changed a workspace holding the learner's work"
    assert edited_stage(workspace) == 2
    (workspace / "notes.md").unlink()  # as written again: replaced
    make_workspace(1, workspace, force=True)
    assert edited_stage(workspace) == 1 and not (workspace / "notes.md").exists()


def test_a_workspace_without_its_list_of_files_is_never_replaced(tmp_path):
    workspace = make_workspace(0, tmp_path / "ex")
    (workspace / WORKSPACE_MARK).write_text("stage 0\n")  # written before the list existed
    assert workspace_changes(workspace)
    with pytest.raises(FileExistsError):
        make_workspace(0, workspace, force=True)
    assert (workspace / "minipaged" / "stage0_contiguous.py").is_file()


def test_cli_writes_a_workspace_and_grades_it(tmp_path):
    out = tmp_path / "ex0"
    cli = [sys.executable, "-m", "minipaged.cli"]
    done = subprocess.run([*cli, "exercise", "0", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and "pytest -k stage0" in done.stdout
    assert "NotImplementedError('stage 0:" in (out / "minipaged" / "stage0_contiguous.py").read_text()
    graded = subprocess.run([*cli, "grade", str(out), "--stage", "0", "--stage", "1"],
                            capture_output=True, text=True, cwd=REPO_DIR)
    assert graded.returncode == 1, graded.stderr
    row = next(line for line in graded.stdout.splitlines() if line.startswith("0 "))
    assert re.match(r"0\s+0/\d+\s+not started", row)
    assert re.search(r"^1\s+(\d+)/\1\s+complete$", graded.stdout, re.M)  # stage 1 is the reference
    again = subprocess.run([*cli, "exercise", "0", "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr


def test_grade_table_format():
    rows = [StageResult(0, 12, 0, 1), StageResult(1, 3, 4, 0), StageResult(2, 0, 9, 0)]
    table = format_grades(rows)
    assert "12/12  complete" in table and "3/7  in progress" in table and "0/9  not started" in table


def test_the_mutant_catalogue_patches_solutions_only_and_covers_every_stage():
    from minipaged.learn.mutants import CATALOGUE, apply_mutant, stage_sources

    files = stage_files()
    patched, by_stage = set(), {stage: stage_sources(stage, REPO_DIR / "minipaged") for stage in files}
    for mutant in CATALOGUE:  # each old text occurs once in its stage's files, inside a solution region
        sources = by_stage[mutant.stage]
        mutated = apply_mutant(sources, mutant)
        assert mutated != sources and mutated.keys() == sources.keys()
        patched |= {name for name in sources if mutated[name] != sources[name]}
    counts = {stage: sum(m.stage == stage for m in CATALOGUE) for stage in files}
    assert min(counts.values()) >= 6, counts
    assert counts[6] >= 9  # one mutant per scheduling rule, at least
    with_solutions = {path.name for paths in files.values() for path in paths if solution_regions(path.read_text())}
    assert patched == with_solutions, "a stage file whose solutions no mutant patches"


def test_a_patch_outside_a_solution_is_refused():
    from minipaged.learn.mutants import Mutant, apply_mutant

    path = stage_files()[1][0]
    sources = {path.name: path.read_text()}
    outside = Mutant(1, "outside", (("class OutOfBlocksError(RuntimeError):", "class OutOfBlocksError(Exception):"),))
    with pytest.raises(ValueError, match="outside a solution"):
        apply_mutant(sources, outside)
    missing = Mutant(1, "missing", (("no such text", "x"),))
    with pytest.raises(ValueError, match="0 times"):
        apply_mutant(sources, missing)


def test_a_mutants_patches_go_to_whichever_file_of_its_stage_holds_them():
    from minipaged.learn.mutants import Mutant, apply_mutant

    body = "def f():\n    # BEGIN SOLUTION\n    return {}\n    # END SOLUTION\n"
    sources = {"a.py": body.format("'a'"), "b.py": body.format("'b'")}
    both = apply_mutant(sources, Mutant(6, "both", (("return 'a'", "return 'x'"), ("return 'b'", "return 'y'"))))
    assert both == {"a.py": body.format("'x'"), "b.py": body.format("'y'")}
    assert apply_mutant(sources, Mutant(6, "one", (("return 'b'", "return 'y'"),)))["a.py"] == sources["a.py"]
    with pytest.raises(ValueError, match="2 times"):  # once in each file is twice in the stage
        apply_mutant(sources, Mutant(6, "ambiguous", (("    return ", "    return not "),)))


def test_a_surviving_mutant_is_reported():
    from minipaged.learn.mutants import Mutant, format_mutants, run_mutants

    harmless = Mutant(1, "an equivalent rewrite",
                      (("return len(self._free_stack)", "return len(self._free_stack) + 0"),))
    wrong = Mutant(1, "double free accepted", (("        if self._is_free[block_id]:\n            raise ValueError(",
                                                "        if False:\n            raise ValueError("),))
    results = run_mutants(catalogue=[harmless, wrong], jobs=1)
    assert [r.killed for r in results] == [False, True]
    assert "test_stage1_block_allocator.py::" in results[1].killed_by
    table = format_mutants(results)
    assert "SURVIVED" in table and table.splitlines()[-1] == "mutants: 1/2 killed"


def test_a_recorded_killer_runs_first_and_never_decides_the_verdict(tmp_path):
    from minipaged.learn.mutants import Mutant, mutant_key, record_killers, recorded_killers, run_mutants

    double_free = (("        if self._is_free[block_id]:\n            raise ValueError(",
                    "        if False:\n            raise ValueError("),)
    allocator = "tests/test_stage1_block_allocator.py::"
    machine = allocator + "TestAllocatorMachine::runTest"  # fails under it, but is not the first test that does
    first_run = [Mutant(1, "double free accepted, machine first", double_free),
                 Mutant(1, "double free accepted, a passing test first", double_free),
                 Mutant(1, "double free accepted, a test that is gone first", double_free),
                 Mutant(1, "an equivalent rewrite", (("return len(self._free_stack)",
                                                      "return len(self._free_stack) + 0"),))]
    first = [machine, allocator + "test_lowest_ids_first_and_freed_blocks_are_reused",
             allocator + "test_no_such_test", machine]
    results = run_mutants(catalogue=first_run, jobs=1,
                          killed_by={mutant_key(mu): test for mu, test in zip(first_run, first, strict=True)})
    assert [r.killed for r in results] == [True, True, True, False]
    assert results[0].killed_by == machine
    assert results[1].killed_by == results[2].killed_by == allocator + "test_double_free_is_refused_and_changes_nothing"

    record = tmp_path / "killed_by.json"
    record.write_text('{"1: a mutant no longer catalogued": "tests/x.py::test_x"}')
    record_killers(results, record, catalogue=first_run)
    assert recorded_killers(record) == {mutant_key(r.mutant): r.killed_by for r in results if r.killed}


def test_the_recorded_killers_are_every_catalogued_mutants_and_name_tests_that_exist():
    from minipaged.learn.mutants import CATALOGUE, mutant_key, recorded_killers, stage_test_files

    killers = recorded_killers()
    assert len({mutant_key(mu) for mu in CATALOGUE}) == len(CATALOGUE), "two mutants of a stage share a name"
    assert set(killers) == {mutant_key(mu) for mu in CATALOGUE}, "run: minipaged mutants --record"
    for key, test in killers.items():
        path, name = test.split("[")[0].split("::")[:2]
        assert path in stage_test_files(REPO_DIR, int(key.split(":")[0])), (key, test)
        tree = ast.parse((REPO_DIR / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        defined |= {target.id for node in tree.body if isinstance(node, ast.Assign)  # a state machine's TestCase
                    for target in node.targets if isinstance(target, ast.Name)}
        assert name in defined, (key, test)


def test_mutants_run_every_file_that_holds_a_stages_tests(tmp_path):
    """The catalogue collects only the files ``stage_test_files`` names: every test pytest marks
    ``stageN`` must be in one of them, however its mark was given."""
    from minipaged.learn.mutants import stage_test_files

    (tmp_path / "stage_marks.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        for mark in item.iter_markers():\n"
        "            if mark.name.startswith('stage'):\n"
        "                print('MARK', mark.name, item.nodeid.split('::')[0])\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "stage_marks",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    marked = {tuple(line.split()[1:]) for line in done.stdout.splitlines() if line.startswith("MARK ")}
    assert {name for name, _ in marked} >= {f"stage{n}" for n in range(15)}
    for name, path in marked:
        assert path in stage_test_files(REPO_DIR, int(name.removeprefix("stage"))), (name, path)
    assert stage_test_files(REPO_DIR, 1) == ["tests/test_stage1_block_allocator.py"]  # not stage 10's


def test_grade_lists_the_failures_and_names_the_lowest_failing_stage_as_the_cause():
    rows = [StageResult(1, 5, 2, 0, ["tests/test_stage1_x.py::a", "tests/test_stage1_x.py::b"]),
            StageResult(2, 9, 0, 0), StageResult(3, 1, 4, 0, ["tests/test_stage3_x.py::c"])]
    text = format_grades(rows, edited=3)
    assert "failed: tests/test_stage1_x.py::a" in text and "failed: tests/test_stage3_x.py::c" in text
    assert "likely cause: stage 1" in text.splitlines()[-1]
    assert "likely cause" not in format_grades(rows[1:], edited=3)  # only the edited stage fails


# Lines of a stage's solutions that a file of its workspace may hold, each with the reason.
# Everything else that quotes a solution line fails the check below.
ALLOWED_QUOTES = {
    # A call's keyword arguments, continued on a line of their own.
    (2, "tests/test_stage0_contiguous.py"): {"num_kv_heads=num_kv_heads, head_dim=head_dim)"},
    (2, "tutorials/00_contiguous_kv_cache.ipynb"): {"num_kv_heads=num_kv_heads, head_dim=head_dim)"},
    # Tutorial 05 re-derives the kernels' indexing in cells of its own (cells 9, 15 and 28).
    (5, "tutorials/05_triton_kernel.ipynb"): {
        "heads = kv_head * GROUP + offs_g", "pos = start + tl.arange(0, BLOCK_N)",
        "offs_d = tl.arange(0, D_PAD)", "valid = pos < seq_len", "part = tl.program_id(2)",
    },
    # The order of the block moves is the scheduler's contract with its runner (stage 6's tests).
    (7, "tests/helpers_scheduler.py"): {
        "self.cache.swap_out(out.blocks_to_swap_out)", "self.cache.swap_in(out.blocks_to_swap_in)",
        "self.cache.copy_blocks(out.blocks_to_copy)",
    },
}


PLAIN_LOOP = re.compile(r"for [\w, ]+ in [\w.]+:$")  # names only what it walks: says nothing


def solution_lines(path: Path) -> set[str]:
    """The lines of a file's solutions that say something: code longer than 20 characters,
    neither a comment nor a plain loop over a named collection."""
    lines = path.read_text().splitlines()
    found = set()
    for begin, end, _ in solution_regions(path.read_text(), str(path)):
        for line in lines[begin : end - 1]:
            text = line.strip()
            if (len(text) > 20 and not text.startswith(("#", '"""', "'''", 'f"""'))
                    and not PLAIN_LOOP.match(text)):
                found.add(text)
    return found


def stage_solution_lines(stage: int) -> set[str]:
    """The solution lines of every file of a stage."""
    return set().union(*(solution_lines(path) for path in stage_files()[stage]))


def given_lines(package: Path, stage: int) -> set[str]:
    """The lines of the package's code that lie outside stage ``stage``'s solutions: code that
    every workspace holds by design (the other stages, the stubbed file's own code)."""
    found, stubbed = set(), stage_files(package)[stage]
    for path in package.rglob("*.py"):
        if path.name == "mutants.py":
            continue
        lines = path.read_text().splitlines()
        if path in stubbed:
            for begin, end, _ in solution_regions(path.read_text()):
                lines[begin - 1 : end] = [""] * (end - begin + 1)
        found.update(line.strip() for line in lines)
        found.update(line.split("  #")[0].strip() for line in lines)  # the code without its comment
    return found


def readable_text(path: Path) -> str:
    """A file's text as a reader sees it: a notebook's cells, not their JSON escapes."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    return text


def quotes(text: str, line: str) -> bool:
    """Whether ``text`` holds ``line`` whole (not as the tail of a longer name or attribute)."""
    return re.search(rf"(?<![\w.]){re.escape(line)}(?!\w)", text) is not None


@pytest.mark.parametrize("number", STAGES)
def test_no_file_of_a_workspace_quotes_the_solutions_it_asks_for(number, tmp_path):
    workspace = make_workspace(number, tmp_path / "ws")
    for stage, path in FILES:  # only this stage's files with solutions are stubbed: the others are given
        stubbed = (workspace / "minipaged" / path.name).read_text() != path.read_text()
        assert stubbed == (stage == number and path in files_to_write(stage)), path.name
    secrets = stage_solution_lines(number) - given_lines(REPO_DIR / "minipaged", number)
    assert len(secrets) >= 5, "too few lines to search for"
    quoted = {}
    for path in workspace.rglob("*"):
        if path.is_file() and path.suffix not in (".safetensors", ".png", ".pyc"):
            name = path.relative_to(workspace).as_posix()
            text = readable_text(path)
            found = {line for line in secrets if quotes(text, line)} - ALLOWED_QUOTES.get((number, name), set())
            if found:
                quoted[name] = sorted(found)
    assert not quoted, f"the workspace quotes its solutions: {quoted}"


def test_the_quote_check_finds_the_mutant_catalogue():
    catalogue = (REPO_DIR / "minipaged" / "learn" / "mutants.py").read_text()
    for number in STAGES:
        secrets = stage_solution_lines(number) - given_lines(REPO_DIR / "minipaged", number)
        assert any(quotes(catalogue, line) for line in secrets), f"no stage-{number} line found in mutants.py"


def test_the_mutants_command_is_refused_in_a_workspace(tmp_path):
    workspace = make_workspace(1, tmp_path / "ws")
    assert not (workspace / "minipaged" / "mutants.py").exists()
    installed = str(Path(sys.executable).parent / "minipaged")  # the repository's package
    for command, cwd in [([sys.executable, "-m", "minipaged.cli"], workspace),  # the workspace's
                         ([installed], workspace / "tests")]:
        done = subprocess.run([*command, "mutants", "--stage", "1"], cwd=cwd, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == "" and "workspace" in done.stderr


def test_grade_shows_where_and_why_each_test_failed(tmp_path):
    workspace = make_workspace(1, tmp_path / "ws")
    (path,) = stage_files()[1]
    reference = path.read_text()
    wrong = reference.replace("        if self._is_free[block_id]:\n            raise ValueError(",
                              "        if False:\n            raise ValueError(")
    assert wrong != reference
    (workspace / "minipaged" / path.name).write_text(wrong)  # a double free accepted
    graded = subprocess.run([sys.executable, "-m", "minipaged.cli", "grade", ".", "--stage", "1"],
                            cwd=workspace, capture_output=True, text=True)
    assert graded.returncode == 1, graded.stderr
    lines = graded.stdout.splitlines()
    failed = [i for i, line in enumerate(lines) if line.strip().startswith("failed: ")]
    assert failed
    for i in failed:
        where = re.match(r"\s+(tests/test_\w+\.py):(\d+): (.+)$", lines[i + 1])
        assert where, lines[i:i + 3]
        source = (workspace / where[1]).read_text().splitlines()[int(where[2]) - 1].strip()
        assert source == where[3] or where[3].endswith("…") and source.startswith(where[3][:-1])
        assert lines[i + 2].strip() and not lines[i + 2].strip().startswith("failed: ")
    assert any("raises(ValueError)" in lines[i + 1] for i in failed)  # the test that expected it


def test_grade_table_lists_each_failures_reason_under_it():
    rows = [StageResult(1, 1, 1, 0, ["tests/test_stage1_x.py::a"],
                        {"tests/test_stage1_x.py::a": ["tests/test_stage1_x.py:7: assert f() == 3",
                                                       "assert 2 == 3"]})]
    lines = format_grades(rows).splitlines()
    at = next(i for i, line in enumerate(lines) if "failed: tests/test_stage1_x.py::a" in line)
    assert [line.strip() for line in lines[at + 1 : at + 3]] == [
        "tests/test_stage1_x.py:7: assert f() == 3", "assert 2 == 3"]


def test_the_suggested_workspace_folders_are_ignored_by_git():
    if not (REPO_DIR / ".git").exists():
        pytest.skip("not a git checkout")
    suggested = set()
    for page in (REPO_DIR / "README.md", REPO_DIR / "docs" / "exercises" / "index.md"):
        suggested |= set(re.findall(r"minipaged exercise \d+ --out (\S+)", page.read_text()))
    assert suggested, "no --out example found"
    for folder in sorted(suggested | {"minipaged-exercise-3"}):
        for inside in ("minipaged/stage0_contiguous.py", "notes.md"):
            done = subprocess.run(["git", "check-ignore", "-q", f"{folder}/{inside}"], cwd=REPO_DIR)
            assert done.returncode == 0, f"{folder}/{inside} is not git-ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "minipaged/stage0_contiguous.py"],
                          cwd=REPO_DIR).returncode == 1


def test_workspace_tutorials_import_the_workspace_and_drop_pieces_named_by_a_solution():
    reference = "def f():\n    # BEGIN SOLUTION\n    x = secret()\n    return x\n    # END SOLUTION\n"
    stubbed = "def f():\n    raise NotImplementedError('stage 1')\n"
    cell = "show(f, start='x = secret()', stop=\"return x\")\nshow(f, start='def f')\nshow(g, stop='other')\n"
    notebook = {"cells": [{"cell_type": "code", "id": "a", "metadata": {}, "outputs": [],
                           "execution_count": None, "source": [cell]}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    out = json.loads(workspace_notebook(json.dumps(notebook), [(reference, stubbed)]))
    first, second = ("".join(c["source"]) for c in out["cells"])
    assert second == "show(f)\nshow(f, start='def f')\nshow(g, stop='other')\n"
    assert WORKSPACE_MARK in first and "sys.path.insert(0" in first
    assert len({c["id"] for c in out["cells"]}) == 2
    # two files: the piece goes when the file whose solution held it loses it, even though the
    # other file's own code says "return x" too
    other = "def g():\n    return x\n"
    out = json.loads(workspace_notebook(json.dumps(notebook), [(other, other), (reference, stubbed)]))
    assert "".join(out["cells"][1]["source"]) == second


def test_every_option_of_every_command_has_help_and_shows_its_default():
    from minipaged import __version__
    from minipaged.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
                assert f"default: {action.default}" in text, f"{name} {action.option_strings[0]}"
    assert "default: 0.8" in " ".join(commands["generate"].format_help().split())
    assert "default: 8000" in " ".join(commands["serve"].format_help().split())
    out = subprocess.run([sys.executable, "-m", "minipaged.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.split() == ["minipaged", __version__]
