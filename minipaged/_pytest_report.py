"""A pytest plugin that records each test's outcome and stage markers as JSON.

Loaded by the exercise tool with ``-p minipaged._pytest_report``; writes to the file
named by the ``MINIPAGED_REPORT`` environment variable.
"""

from __future__ import annotations

import json
import os
import re

_STAGE = re.compile(r"stage(\d+)$")
_records: dict[str, dict] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        stages = sorted({int(m.group(1)) for mark in item.iter_markers() if (m := _STAGE.match(mark.name))})
        _records[item.nodeid] = {"outcome": "skipped", "stages": stages}


def pytest_runtest_logreport(report):
    record = _records.get(report.nodeid)
    if record is None:
        return
    if report.failed:
        record["outcome"] = "failed"
    elif report.when == "call" and report.passed and record["outcome"] != "failed":
        record["outcome"] = "passed"


def pytest_sessionfinish(session):
    path = os.environ.get("MINIPAGED_REPORT")
    if path:
        selected = {item.nodeid for item in session.items}
        with open(path, "w") as f:
            json.dump({k: v for k, v in _records.items() if k in selected}, f)
