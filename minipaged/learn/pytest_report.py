"""A pytest plugin that records each test's outcome, stage markers and reason for failing, as JSON.

Loaded by the exercise tool with ``-p minipaged.learn.pytest_report``; writes to the file
named by the ``MINIPAGED_REPORT`` environment variable. A failing test's ``reason`` is the
line of the test where it failed (``path:line: source``, often the ``assert``) and the
first line of the error (``assert 2 == 3``, ``NotImplementedError: stage 1: ...``).
"""

from __future__ import annotations

import json
import os
import re

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


def pytest_runtest_logreport(report):
    record = _records.get(report.nodeid)
    if record is None:
        return
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
