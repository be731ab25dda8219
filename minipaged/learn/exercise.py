"""The exercise tool: turn a stage's solutions into stubs, and grade a workspace.

A learner's part of a stage sits between two marker comments::

    def holes(self):
        \"\"\"The free holes of the arena.\"\"\"
        # BEGIN SOLUTION walk the slabs in address order and collect the gaps
        ...
        # END SOLUTION

``make_workspace(stage, out)`` copies the package and the stage tests into ``out`` and
replaces every solution of that stage, in each of its files, by ``raise
NotImplementedError("stage N: <hint> — see tutorials/NN_<topic>.ipynb")``; signatures and
docstrings stay. Grading a workspace is ``minipaged.learn.grade``'s.

A stage owns one file, ``stageN_<topic>.py``, or two where it holds two ideas (stage 6's
scheduler and its swapping); ``stage_files`` lists them, the stage's main file first.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # minipaged/, the folder above learn/
REPO_DIR = PACKAGE_DIR.parent
STAGE_FILE = re.compile(r"stage(\d+)_(\w+)\.py$")
WORKSPACE_MARK = ".minipaged-exercise"  # written into every workspace: --force replaces only those


class SolutionMarkerError(ValueError):
    """The solution markers of a file are unbalanced, nested or misplaced."""


def _runtime_imports(path: Path) -> set[str]:
    """The modules a file imports, at its top level or inside a function, not those under ``if
    TYPE_CHECKING:`` (for ``from x import y``, both ``x`` and ``x.y``: ``y`` may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def stage_files(package_dir: Path = PACKAGE_DIR) -> dict[int, list[Path]]:
    """The modules of every stage of the package, by stage number, the stage's main file first.

    The main file is the one that imports the most of the stage's other files (the scheduler imports
    its swapping; V1's scheduler its runner), and of two that import as many, the one the other
    builds on (V1's async engine imports V1's scheduler): the stage's entry, whose topic names the
    stage's tutorial and docs page. The others follow by name.
    """
    found: dict[int, list[Path]] = {}
    for path in sorted(package_dir.glob("stage*_*.py")):
        match = STAGE_FILE.match(path.name)
        if match:
            found.setdefault(int(match.group(1)), []).append(path)
    for stage, paths in found.items():
        imports = {path: {name.rsplit(".", 1)[-1] for name in _runtime_imports(path)} for path in paths}
        rank = {p: (sum(o.stem in imports[p] for o in paths if o != p),  # stage files it imports,
                    sum(p.stem in imports[o] for o in paths if o != p))  # then stage files that import it
                for p in paths}
        main = max(paths, key=rank.__getitem__)
        found[stage] = [main, *(p for p in paths if p != main)]
    return dict(sorted(found.items()))


def files_to_write(stage: int, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The files of a stage that hold solutions, the main file first: what its exercise stubs.
    A stage's other files are read, not written (stage 7's engine loop).

    In the workspace of this stage's exercise the solutions' markers are gone (stubbed, then
    the learner's code): there the files are those its mark file lists (``writes``)."""
    paths = stage_files(package_dir)[stage]
    stubbed = workspace_writes(Path(package_dir).parent)
    if stubbed is not None and stubbed[0] == stage:
        return [path for path in paths if path.name in stubbed[1]]
    return [path for path in paths if solution_regions(path.read_text(), str(path))]


def workspace_writes(directory: Path) -> tuple[int, list[str]] | None:
    """The stage of an exercise workspace and the names of the files it stubbed (its mark file's
    ``writes`` line); None for a folder that is no workspace, or one without the line."""
    mark = Path(directory) / WORKSPACE_MARK
    lines = mark.read_text().splitlines() if mark.is_file() else []
    stage = edited_stage(directory)
    writes = next((line.split()[1:] for line in lines[1:] if line.startswith("writes ")), None)
    return None if stage is None or writes is None else (stage, writes)


def tutorial_for(stage: int, repo_dir: Path = REPO_DIR) -> str:
    """The tutorial notebook that explains a stage, as a path relative to the repository."""
    named = stage_files(repo_dir / "minipaged").get(stage)  # a notebook named by the stage's topic first
    topic = named[0].stem.split("_", 1)[1] if named else "-"
    matches = sorted((repo_dir / "tutorials").glob(f"[0-9][0-9]_{topic}.ipynb")) or sorted(
        (repo_dir / "tutorials").glob(f"{stage:02d}_*.ipynb"))
    return f"tutorials/{matches[0].name}" if matches else f"tutorials/{stage:02d}_*.ipynb"


def solution_regions(source: str, filename: str = "<source>") -> list[tuple[int, int, str]]:
    """The ``(begin_line, end_line, hint)`` of each solution, 1-based, in order.

    Raises ``SolutionMarkerError`` naming the file and line of a nested BEGIN, an END
    without a BEGIN, a BEGIN never closed, or a BEGIN outside a function body.
    """
    regions, open_at, hint = [], None, ""
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if open_at is not None:
                raise SolutionMarkerError(
                    f"{filename}:{number}: nested {BEGIN!r}; the one at line {open_at} is still open"
                )
            if not line[: len(line) - len(line.lstrip())]:
                raise SolutionMarkerError(
                    f"{filename}:{number}: {BEGIN!r} must be inside a function body (indented)"
                )
            open_at, hint = number, stripped[len(BEGIN) :].strip(" :-—")
        elif stripped.startswith(END):
            if open_at is None:
                raise SolutionMarkerError(f"{filename}:{number}: {END!r} without a {BEGIN!r}")
            regions.append((open_at, number, hint))
            open_at = None
    if open_at is not None:
        raise SolutionMarkerError(f"{filename}:{open_at}: {BEGIN!r} is never closed by {END!r}")
    return regions


def solution_functions(source: str, filename: str = "<source>") -> list[str]:
    """The qualified names (``Class.method``) of the functions that hold a solution, in order.

    Each solution belongs to the innermost function around its BEGIN marker: the pieces an
    exercise asks for, and what a stage's exercise page and tutorial must name.
    """
    functions: list[tuple[int, int, str]] = []  # (first line, last line, qualified name)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((child.lineno, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    names: list[str] = []
    for begin, _, _ in solution_regions(source, filename):
        # a trailing END comment lies past the function's end_lineno, so look at BEGIN only
        enclosing = [f for f in functions if f[0] < begin <= f[1]]
        name = min(enclosing, key=lambda f: f[1] - f[0])[2]
        if name not in names:
            names.append(name)
    return names


def triton_kernel_lines(source: str, filename: str = "<source>") -> set[int]:
    """The line numbers inside functions decorated with ``triton.jit`` (``@triton.jit(...)`` too)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("triton.jit", "jit")
                for d in node.decorator_list):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def stub_source(source: str, stage: int, tutorial: str, filename: str = "<source>") -> str:
    """``source`` with each solution replaced by a ``NotImplementedError`` stub.

    Inside a Triton kernel the stub raises only in Triton's interpreter; compiled for a GPU
    it prints its hint at compile time and computes nothing, so the tests fail with the hint
    in their output there too, instead of a compile error.
    """
    lines = source.splitlines(keepends=True)
    kernels = triton_kernel_lines(source, filename)
    out, cursor = [], 0
    for begin, end, hint in solution_regions(source, filename):
        out.extend(lines[cursor : begin - 1])
        marker = lines[begin - 1]
        indent = marker[: len(marker) - len(marker.lstrip())]
        message = f"stage {stage}: {hint or 'implement this'} — see {tutorial}"
        if begin in kernels:  # Triton compiles this for a GPU, where ``raise`` does not compile
            out.append(f"{indent}if triton.knobs.runtime.interpret:  # Triton's interpreter runs this as Python\n")
            out.append(f"{indent}    raise NotImplementedError({message!r})\n")
            out.append(f"{indent}tl.static_print({message!r})  # a GPU compiles the stub, prints this, does nothing\n")
        else:
            out.append(f"{indent}raise NotImplementedError({message!r})\n")
        cursor = end
    out.extend(lines[cursor:])
    stubbed = "".join(out)
    try:
        ast.parse(stubbed, filename)
    except SyntaxError as err:
        raise SolutionMarkerError(f"{filename}:{err.lineno}: stubs do not compile: {err.msg}") from err
    return stubbed


# Written by tools, never by the learner: --force replaces a workspace that holds only these.
CACHES = ("__pycache__", ".pytest_cache", ".hypothesis")
# Left out of every workspace: the catalogue's patches quote the solutions of every stage, and
# its record names each wrong implementation.
ANSWER_FILES = ("mutants.py", "mutants_killed_by.json")
WORKSPACE_CELL = (
    "# This notebook is in an exercise workspace: import the workspace's minipaged (your code),\n"
    "# not an installed one. Run this cell first.\n"
    "import sys\n"
    "from pathlib import Path\n"
    "\n"
    "here = Path.cwd().resolve()\n"
    f"marked = [p for p in (here, *here.parents) if (p / {WORKSPACE_MARK!r}).is_file()]\n"
    "sys.path.insert(0, str(marked[0] if marked else here.parent))  # the workspace's root"
)


def find_workspace(start: Path) -> Path | None:
    """The exercise workspace holding ``start`` (it or a folder above it), if any."""
    start = Path(start).resolve()
    return next((p for p in (start, *start.parents) if (p / WORKSPACE_MARK).is_file()), None)


def _workspace_files(out: Path) -> dict[str, Path]:
    """Every file of a folder by relative path, tools' caches left out."""
    return {path.relative_to(out).as_posix(): path for path in sorted(out.rglob("*"))
            if path.is_file() and not set(path.relative_to(out).parts) & set(CACHES)
            and path.suffix != ".pyc" and path.name != WORKSPACE_MARK}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def workspace_manifest(out: Path) -> dict[str, str]:
    """The files ``exercise`` wrote into a workspace, by relative path, with their SHA-256
    (empty for a folder that is no workspace, or one written before the list existed).

    The learner's own record, which ``exercise --force`` reads to keep their work; it lies in
    their folder, so the grader never trusts it (it compares with ``grader_files``)."""
    mark = Path(out) / WORKSPACE_MARK
    lines = mark.read_text().splitlines()[1:] if mark.is_file() else []
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines if "  " in line)}


def workspace_changes(out: Path) -> list[str]:
    """What the learner changed in a workspace: files edited or added since ``exercise`` wrote it.

    The mark file lists every file it wrote with its SHA-256; a workspace written before the
    list existed counts as changed (nothing proves otherwise).
    """
    written = workspace_manifest(out)
    if not written:
        return ["(no list of the files it wrote)"]
    changes = []
    for name, path in _workspace_files(Path(out)).items():
        if name not in written:
            changes.append(f"{name} (added)")
        elif _digest(path) != written[name]:
            changes.append(f"{name} (edited)")
    return changes


TEST_FILES = ("test_stage", "conftest", "helpers")  # the tests a workspace holds: the stage tests and their help
CONFIG_FILES = ("conftest.py", "pyproject.toml")  # pytest's configuration, beside the package


def _tests_dir(repo_dir: Path) -> Path:
    tests_dir = repo_dir / "tests"
    if not tests_dir.is_dir():
        raise FileNotFoundError(
            f"the tests are not next to the package ({tests_dir}); run this from a clone "
            "of the minipaged repository"
        )
    return tests_dir


def grader_files(repo_dir: Path = REPO_DIR) -> dict[str, Path]:
    """The files every workspace holds as ``exercise`` copies them from ``repo_dir``, by relative
    path: the tests, pytest's configuration and the grader (``minipaged/learn/``). No learner
    edits them; the grader checks a workspace's against these and runs these."""
    tests_dir = _tests_dir(repo_dir)
    files = {f"tests/{path.name}": path for path in sorted(tests_dir.glob("*.py")) if path.name.startswith(TEST_FILES)}
    files |= {name: repo_dir / name for name in CONFIG_FILES}
    learn = repo_dir / "minipaged" / "learn"
    files |= {f"minipaged/learn/{name}": path for name, path in _workspace_files(learn).items()
              if path.name not in ANSWER_FILES}
    return files


def copy_workspace(out: Path, repo_dir: Path = REPO_DIR, force: bool = False) -> Path:
    """Copy the package, the stage tests, the tutorials and the docs into ``out``: a workspace.

    ``out`` must be missing or empty, or, with ``force``, a workspace that this tool wrote
    and that holds no change of the learner's: nothing the learner wrote is ever deleted.
    """
    tests_dir = _tests_dir(repo_dir)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
        if not (out / WORKSPACE_MARK).is_file():  # never delete what this tool did not write
            raise FileExistsError(f"{out} is not an exercise workspace written by minipaged; "
                                  "--force replaces only those: choose another --out")
        changes = workspace_changes(out)
        if changes:
            shown = ", ".join(changes[:5]) + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")
            raise FileExistsError(
                f"{out} holds your work: {shown}. --force replaces only a workspace that is as "
                f"`exercise` wrote it; to start afresh, move it away first (mv {out} {out}-mine) "
                "or choose another --out"
            )
        shutil.rmtree(out)
    package_ignore = shutil.ignore_patterns(*CACHES, "*.pyc", *ANSWER_FILES)
    shutil.copytree(repo_dir / "minipaged", out / "minipaged", ignore=package_ignore)
    (out / "tests").mkdir(parents=True)
    for path in tests_dir.glob("*.py"):
        if path.name.startswith(TEST_FILES):
            shutil.copy2(path, out / "tests" / path.name)
    for name in CONFIG_FILES:
        shutil.copy2(repo_dir / name, out / name)
    for folder in ("tutorials", "docs"):  # what the stubs and the README point to
        if (repo_dir / folder).is_dir():
            shutil.copytree(repo_dir / folder, out / folder,
                            ignore=shutil.ignore_patterns("tutorials", ".*", *CACHES))
    (out / WORKSPACE_MARK).write_text("workspace\n")
    return out


_ANCHOR = re.compile(r"""\s*,\s*(?:start|stop)\s*=\s*("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')""")


def workspace_notebook(text: str, sources: list[tuple[str, str]]) -> str:
    """A tutorial as a workspace holds it: a first cell that imports the workspace's package,
    and no ``show(..., start=..., stop=...)`` piece named by a text of the stubbed solutions
    (the learner's code does not hold it: the whole function is shown instead).

    ``sources``: the ``(reference, stubbed)`` text of each stubbed file. A piece is dropped
    when a file's reference holds its text and the same file's stubs do not."""

    def keep(match: re.Match) -> str:
        anchor = ast.literal_eval(match.group(1))
        gone = any(anchor in reference and anchor not in stubbed for reference, stubbed in sources)
        return "" if gone else match.group(0)

    notebook = json.loads(text)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            cell["source"] = _ANCHOR.sub(keep, source).splitlines(keepends=True)
    first = {"cell_type": "code", "execution_count": None, "id": "minipaged-workspace",
             "metadata": {"tags": ["minipaged-workspace"]}, "outputs": [],
             "source": WORKSPACE_CELL.splitlines(keepends=True)}
    if "id" not in notebook["cells"][0]:
        first.pop("id")
    notebook["cells"].insert(0, first)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def make_workspace(stage: int, out: Path, force: bool = False, repo_dir: Path = REPO_DIR) -> Path:
    """Write an exercise workspace for ``stage`` into ``out``: stage ``stage``'s solutions are stubs.

    Nothing in it quotes those solutions: the mutant catalogue is left out, and the tutorials
    show the workspace's own code. ``force``: see ``copy_workspace``.
    """
    files = stage_files(repo_dir / "minipaged")
    if stage not in files:
        raise ValueError(f"no stage {stage}; stages available: {sorted(files)}")
    out = copy_workspace(out, repo_dir, force)
    tutorial = tutorial_for(stage, repo_dir)
    sources = []  # (reference, stubbed) of each file of the stage
    for path in files[stage]:
        target = out / "minipaged" / path.name
        reference = target.read_text()
        stubbed = stub_source(reference, stage, tutorial, str(path))
        target.write_text(stubbed)
        sources.append((reference, stubbed))
    for notebook in sorted((out / "tutorials").glob("*.ipynb")):
        notebook.write_text(workspace_notebook(notebook.read_text(), sources))
    written = files_to_write(stage, repo_dir / "minipaged")
    names = [f"`minipaged/{path.name}`" for path in written]
    (out / "README.md").write_text(
        f"# Exercise {stage}\n\n"
        f"Fill in every `NotImplementedError` in {' and '.join(names)}.\n"
        f"{tutorial} explains the ideas; docs/exercises/stage{stage}.md lists what each stub must do,\n"
        "in the order to write them, with the tests that check each and hints.\n\n"
        f"Check your work from this folder with `{_python()} -m pytest -k stage{stage}`,\n"
        f"or see every stage at once with `{_python()} -m minipaged.cli grade . --stage {stage}`\n"
        f"(without `--stage`, every stage).\n\n"
        "The tutorials in `tutorials/` run and show your code: their first cell puts this folder\n"
        "first on Python's path. Nothing here is deleted by `exercise --force`: it refuses a\n"
        "workspace that holds your work.\n"
    )
    manifest = [f"{_digest(path)}  {name}" for name, path in _workspace_files(out).items()]
    writes = "writes " + " ".join(path.name for path in written)  # where the markers were: the grader hashes these
    (out / WORKSPACE_MARK).write_text(f"stage {stage}\n{writes}\n" + "\n".join(manifest) + "\n")
    return out


def edited_stage(directory: Path) -> int | None:
    """The stage whose stubs a workspace was written with, if it is one."""
    mark = Path(directory) / WORKSPACE_MARK
    words = (mark.read_text().splitlines() or [""])[0].split() if mark.is_file() else []
    return int(words[1]) if len(words) == 2 and words[0] == "stage" and words[1].isdigit() else None


def _python() -> str:
    return sys.executable
