"""A pytest plugin that records each test's outcome, stage markers and reason for failing, as JSON.

The grader loads its own copy of this file, under a name of its own (``-p`` with a folder
outside the tested one on ``PYTHONPATH``), never the copy in the folder it tests; it writes to
the file named by the ``MINIPAGED_REPORT`` environment variable. It imports nothing of
minipaged, so it is loaded, and counts the GPUs, before any of the tested code runs. A failing
test's ``reason`` is the line of the test where it failed (``path:line: source``, often the
``assert``) and the first line of the error (``assert 2 == 3``, ``NotImplementedError: stage 1:
...``); a skipped test's is the reason it was skipped (``Skipped: needs a CUDA device``), and
``skipped_in`` names the package's line the skip was raised through, if it came from the
package's code rather than from the test (``unittest.SkipTest`` too, which pytest turns into a skip
of its own).

With ``MINIPAGED_GUARD`` (a JSON object: ``package``, ``tests``, ``reference``, ``learners``,
``out``), it also watches the run for shortcuts: a file under the tests or under the reference
package (the installed minipaged) opened by the learner's package, a process or C code started
by the learner's own files (``learners``; what those read, no hook here sees), and modules loaded
from the reference package; it writes what it saw, and the machine the tests ran on, to ``out``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import sys
import sysconfig

import pytest

_STAGE = re.compile(r"stage(\d+)$")
_records: dict[str, dict] = {}
WIDTH = 160  # a reason's line is cut to this many characters


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= WIDTH else text[: WIDTH - 1] + "…"


def _reason(report) -> list[str]:
    """Where the test failed, and the error's first line; what pytest gives of them."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:  # a collection error or a plain text: its last line says most
        lines = [line for line in str(longrepr).splitlines() if line.strip()]
        return [_cut(lines[-1])] if lines else []
    reason = []
    entries = [e for e in getattr(getattr(longrepr, "reprtraceback", None), "reprentries", [])
               if getattr(e, "reprfileloc", None) is not None]
    test_file = report.nodeid.split("::")[0]
    in_tests = [e for e in entries if e.reprfileloc.path.endswith(test_file)] or entries
    if in_tests:
        entry = in_tests[-1]
        source = [line[1:].strip() for line in entry.lines if line.startswith(">")]
        if source:
            reason.append(_cut(f"{test_file}:{entry.reprfileloc.lineno}: {source[-1]}"))
    message = crash.message.strip().splitlines()
    if message:
        reason.append(_cut(message[0]))
    return reason


def pytest_collection_modifyitems(items):
    for item in items:
        stages = sorted({int(m.group(1)) for mark in item.iter_markers() if (m := _STAGE.match(mark.name))})
        _records[item.nodeid] = {"outcome": "skipped", "stages": stages}


def _gpu_count() -> int:
    """The GPUs torch sees, counted as the plugin loads: before any code under test can change torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _package_line(tb) -> str | None:
    """``file:line`` of the innermost frame of the tested package (its tools in ``learn/`` left
    out) in a traceback, if any."""
    found = None
    while tb is not None:
        name = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if name.startswith(_package) and not name.startswith(os.path.join(_package, "learn", "")):
            found = f"{os.path.relpath(name, os.path.dirname(_package.rstrip(os.sep)))}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip raised through the package's code is the package's, not the test's: note where.

    A wrapper, so the exception is read as raised, before any plugin replaces it: pytest turns a
    ``unittest.SkipTest`` into a skip of its own, raised from its own code."""
    tb = call.excinfo.tb if call.excinfo is not None else None
    report = yield
    record = _records.get(item.nodeid)
    if record is not None and tb is not None and report.skipped and not hasattr(report, "wasxfail"):
        where = _package_line(tb)
        if where:
            record["skipped_in"] = where
    return report


def pytest_runtest_logreport(report):
    record = _records.get(report.nodeid)
    if record is None:
        return
    if report.skipped and isinstance(report.longrepr, tuple) and record["outcome"] == "skipped":
        record["reason"] = [_cut(str(report.longrepr[-1]))]
    if report.failed:
        if record["outcome"] != "failed":  # the first phase that failed says why
            record["reason"] = _reason(report)
        record["outcome"] = "failed"
    elif report.when == "call" and report.passed and record["outcome"] != "failed":
        record["outcome"] = "passed"


def pytest_sessionfinish(session):
    path = os.environ.get("MINIPAGED_REPORT")
    if path:
        selected = {item.nodeid for item in session.items}
        with open(path, "w") as f:
            json.dump({k: v for k, v in _records.items() if k in selected}, f)
    if _guard:
        _guard["findings"].extend(_foreign_modules(_guard["reference"], _guard["package"]))
        try:
            machine = environment()
        except Exception as err:  # the GPUs and the versions were read before the tested code ran: they are known
            machine = {**_VERSIONS, "gpus": [f"GPU {i}" for i in range(_GPUS)], "error": repr(err)[:WIDTH]}
        with open(_guard["out"], "w") as f:
            json.dump({"findings": _guard["findings"], "environment": machine}, f)


def _folder(path: str | None) -> str | None:
    return os.path.join(os.path.realpath(path), "") if path else None


def _load_guard() -> dict:
    spec = json.loads(os.environ.get("MINIPAGED_GUARD") or "{}")
    if not spec:
        return {}
    package, tests = os.path.join(os.path.realpath(spec["package"]), ""), _folder(spec["tests"])
    reference = _folder(spec.get("reference"))
    return {"package": package, "tests": tests, "learn": os.path.join(package, "learn", ""),
            "reference": None if reference == package else reference,
            "learners": {os.path.realpath(name) for name in spec.get("learners", [])},
            "root": os.path.dirname(package.rstrip(os.sep)) + os.sep, "out": spec["out"], "findings": []}


def _learners_frame(guard: dict) -> str | None:
    """``file:line`` of the innermost frame of the workspace's own files (its tools in ``learn/``,
    this plugin among them, left out), if it is the learner's package; ``None`` when it is a test
    or a conftest (a test may read its own files), or when no frame of the workspace is on the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        name = os.path.realpath(frame.f_code.co_filename)
        if name.startswith(guard["root"]) and not name.startswith(guard["learn"]):
            if name.startswith(guard["package"]):
                return f"{os.path.relpath(name, guard['root'])}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


def _passed_through(real: str) -> bool:
    """Whether a frame's file (its real path) is the standard library's, or this plugin: frames a
    call passes through on its way from the code that made it."""
    return real == _HERE or (real.startswith(_STDLIB) and not _INSTALLED.search(real))


def _starter(guard: dict) -> str | None:
    """``file:line`` of the learner's own files when they start a process or call C themselves,
    through the standard library only (``subprocess``, ``os.system``, ``ctypes``); ``None`` when
    code they use does it (Triton runs ``ptxas``, torch loads its libraries, the package's own
    server launcher starts ``minipaged serve`` for the tests), or multiprocessing (its children run
    the learner's own Python: stage 11's workers), or the tests."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<"):  # ``<frozen os>``: the standard library's too
            real = os.path.realpath(name)
            if real.startswith(_MULTIPROCESSING):
                return None
            if not _passed_through(real):
                return f"{os.path.relpath(real, guard['root'])}:{frame.f_lineno}" if real in guard["learners"] else None
        frame = frame.f_back
    return None


def _audit(event: str, args: tuple) -> None:
    """An audit hook: the learner's package opening a test's file or the reference package's, or
    starting a process or calling C, whose reads no hook of this process sees."""
    if _busy:
        return
    if event in PROCESS_EVENTS:
        _busy.append(True)
        try:
            where = _starter(_guard)
            finding = {"rule": "reads-tests", "where": where,
                       "reason": f"{event} while the tests run: what it reads, the grader cannot watch"}
            if where and finding not in _guard["findings"]:
                _guard["findings"].append(finding)
        finally:
            _busy.clear()
        return
    if event != "open" or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    _busy.append(True)
    try:
        path = os.path.realpath(os.fsdecode(args[0]))
        watched = [(_guard["tests"], "reads-tests"), (_guard["reference"], "reference")]
        rule = next((rule for folder, rule in watched if folder and path.startswith(folder)), None)
        where = _learners_frame(_guard) if rule else None
        shown = os.path.relpath(path, _guard["root"]) if rule == "reads-tests" else path
        finding = {"rule": rule, "where": where, "reason": f"opens {shown} while the tests run"}
        if rule and where and finding not in _guard["findings"]:
            _guard["findings"].append(finding)
    finally:
        _busy.clear()


def _foreign_modules(reference: str | None, package: str) -> list[dict]:
    """Modules the run loaded from the reference package instead of the workspace's."""
    if not reference:
        return []
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.realpath(file).startswith(reference):
            found.append({"rule": "reference", "where": name,
                          "reason": f"module {name} was loaded from {file}, not from {package}"})
    return found


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def environment() -> dict:
    """The machine and the versions the tests ran with; the GPUs as counted before the tested code ran."""
    found: dict = {"python": platform.python_version(), "implementation": platform.python_implementation(),
                   "platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_name(),
                   "cpu_count": os.cpu_count()}
    found.update(_VERSIONS)
    torch = sys.modules.get("torch")
    found["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    found["gpus"] = [torch.cuda.get_device_name(i) for i in range(_GPUS)] if torch is not None else []
    return found


def _versions() -> dict[str, str | None]:
    """The version of each package the tests need, read as the plugin loads; ``None`` for one that
    cannot be imported here (Triton is built for Linux on x86-64 only)."""
    found: dict[str, str | None] = {}
    for package in ("torch", "triton", "pytest", "hypothesis"):
        try:
            found[package] = importlib.metadata.version(package) if _importable(package) else None
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _importable(name: str) -> bool:
    """Whether ``import name`` finds a module, without importing it (Triton must be imported after
    its interpreter is switched on)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# What a learner's code may not start itself: a process, or C code (``ctypes``).
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                            "os.forkpty", "ctypes.dlopen", "ctypes.dlsym"})
_INSTALLED = re.compile(r"[\\/](site|dist)-packages[\\/]")
_STDLIB = tuple({os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "") for key in ("stdlib", "platstdlib")})
_MULTIPROCESSING = tuple(os.path.join(folder, "multiprocessing", "") for folder in _STDLIB)
_HERE = os.path.realpath(__file__)
_GPUS = _gpu_count()
_VERSIONS = _versions()  # before any code under test runs, like the GPUs
_guard = _load_guard()
_package = _guard["package"] if _guard else os.path.join(os.path.realpath("minipaged"), "")
_busy: list[bool] = []  # set while the hook runs: what it calls opens nothing watched, but never recurse
if _guard:
    sys.addaudithook(_audit)
