"""`minipaged serve` as a real process: bad arguments and ports fail fast in one line; SIGTERM and
SIGINT abort in-flight requests after --shutdown-timeout and exit 0 with one log line each."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minipaged.serving.launcher import start_server

pytestmark = pytest.mark.serving


def start(*args, port=None):
    return start_server("--num-gpu-blocks", "64", "--max-model-len", "512", *args, port=port, timeout=120,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "minipaged.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args", [["--port", "70000"], ["--port", "-1"], ["--host", "0.0.0.0"],
                                  ["--shutdown-timeout", "-3"]])
def test_bad_arguments_fail_in_one_line_before_the_model_loads(args):
    result = run_cli(*args)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0]


def test_a_port_in_use_fails_in_one_line_before_the_model_loads(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        started = time.monotonic()
        result = run_cli("--port", str(taken.getsockname()[1]))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in lines[0]
    assert time.monotonic() - started < 30


def stream_lines(url, out):
    body = {"prompt": "Return the number of", "max_tokens": 500, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
    except httpx.HTTPError as err:
        out.append(f"transport error: {err!r}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_aborts_in_flight_streams_after_the_grace_period_and_exits_0(sig):
    process, url = start("--shutdown-timeout", "0.3")
    events: list[str] = []
    thread = threading.Thread(target=stream_lines, args=(url, events))
    thread.start()
    deadline = time.monotonic() + 30
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    sent = time.monotonic()
    process.send_signal(sig)
    thread.join(30)
    stopped_streaming = time.monotonic() - sent
    process.wait(timeout=30)
    output = process.stdout.read()
    assert process.returncode == 0
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])  # aborted: an error event, then [DONE]
    assert 0.25 < stopped_streaming < 10  # the stream went on for the grace period, then was cut
    assert len(events) < 500
    log = [line for line in output.splitlines() if line.strip() and not line.startswith("minipaged serve: tiny on")]
    assert len(log) == 1 and signal.Signals(sig).name in log[0] and "Traceback" not in output


def test_a_second_ctrl_c_aborts_at_once_without_tracebacks():
    process, url = start("--shutdown-timeout", "60")
    events: list[str] = []
    thread = threading.Thread(target=stream_lines, args=(url, events))
    thread.start()
    while len(events) < 2:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert events[-1] != "[DONE]"  # still streaming: the grace period is 60 s
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    thread.join(30)
    process.wait(timeout=30)
    output = process.stdout.read()
    assert time.monotonic() - sent < 10 and process.returncode == 0
    assert events[-1] == "[DONE]" and "Traceback" not in output
    log = [line for line in output.splitlines() if line.strip() and not line.startswith("minipaged serve: tiny on")]
    assert len(log) == 2


def test_an_idle_server_exits_0_on_sigterm():
    process, url = start()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert process.returncode == 0
