"""``minipaged serve`` as a child process, for the load generator and the process tests: on a
free loopback port, returned once it answers ``/health``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*serve_args: str, port: int | None = None, timeout: float = 180,
                 **popen_kwargs) -> tuple[subprocess.Popen, str]:
    """Start ``minipaged serve --port PORT *serve_args`` and wait until ``/health`` answers 200:
    the process and its URL. ``RuntimeError`` if it stops first (with what it printed, when its
    output is a pipe) or does not answer within ``timeout`` seconds (then it is killed)."""
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "minipaged.cli", "serve", "--port", str(port), *serve_args],
                               text=True, **popen_kwargs)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stdout.read() if process.stdout else ""
            raise RuntimeError(f"the server stopped before answering: {said}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not start within {timeout:g} s")
