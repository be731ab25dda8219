"""``minipaged serve``: check the arguments and the port before the model loads, then run uvicorn.

SIGTERM or SIGINT stop accepting requests, let the running ones go on for ``shutdown_timeout``
seconds, abort the rest and exit 0 (``_server``); a connection that has not sent its headers
within ``read_timeout`` seconds is closed (``header_timeout_protocol``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from contextlib import contextmanager
from typing import TYPE_CHECKING

from minipaged.serving.app import build_app
from minipaged.serving.engine_client import EngineClient
from minipaged.serving.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT,
    LOOPBACK_HOSTS,
)
from minipaged.serving.protocol import DEFAULT_MAX_LOGPROBS

if TYPE_CHECKING:  # imported by serve() only, so that the command line starts without it
    import uvicorn

logger = logging.getLogger("minipaged.serving")


def _server(config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float) -> uvicorn.Server:
    """uvicorn's server with the shutdown of ``minipaged serve``: on SIGTERM or SIGINT, stop
    accepting, abort what still runs after ``shutdown_timeout`` seconds (a second signal: now),
    one log line per signal, and return normally (exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def on_signal(self, sig):
            name, in_flight = signal.Signals(sig).name, engine.num_in_flight
            engine.shutting_down = True
            if not self.should_exit:
                logger.warning("%s: shutting down; %d requests in flight%s", name, in_flight,
                               f", aborted after {shutdown_timeout:g} s" if in_flight and shutdown_timeout
                               else (", aborted now" if in_flight else ""))
                self.should_exit = True
                asyncio.get_running_loop().call_later(shutdown_timeout, engine.abort_all,
                                                      "the server is shutting down")
            else:
                logger.warning("%s again: aborting %d requests now", name, in_flight)
                engine.abort_all("the server is shutting down")

    return Server(config)


def header_timeout_protocol(timeout: float):
    """uvicorn's h11 protocol, closing a connection whose first request has not sent all its
    headers within ``timeout`` seconds (uvicorn has no such timeout of its own)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(timeout, self.headers_too_slow)

        def headers_too_slow(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has started
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self.header_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def check_serve_args(host: str, port: int, shutdown_timeout: float, max_waiting: int) -> None:
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"minipaged serves on the loopback interface only, not {host!r}")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0 .. 65535, got {port}")
    if not shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    if max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening); ``ValueError``, one line, if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def serve(model: str = "tiny", host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 256, *,
          api_key: str | None = None, shutdown_timeout: float = 0.0, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT,
          served_model_name: str | None = None, **engine_args) -> None:
    """Run the server until SIGINT or SIGTERM over ``LLM(model, **engine_args)`` (``EngineConfig``'s
    arguments). Arguments and the port are checked before the model loads (``ValueError``, one
    line); in-flight requests are aborted after ``shutdown_timeout``."""
    import torch
    import uvicorn

    from minipaged.common.config import EngineConfig
    from minipaged.llm import LLM

    EngineConfig(model=model, **engine_args)  # every engine argument, and their combination, checked first
    check_serve_args(host, port, shutdown_timeout, max_waiting)
    sock = bind(host, port)
    logging.basicConfig(format="minipaged serve: %(message)s", level=logging.WARNING)
    try:
        llm = LLM(model, **engine_args)
        name = served_model_name or model
        app = build_app(llm, name, max_waiting, api_key=api_key, max_logprobs=max_logprobs,
                        max_body_bytes=max_body_bytes, read_timeout=read_timeout, model_path=model)
        # uvicorn annotates timeout_graceful_shutdown as an int; it is asyncio.wait_for's timeout, any number
        config = uvicorn.Config(app, log_level="warning",
                                timeout_graceful_shutdown=shutdown_timeout + 5,  # type: ignore[arg-type]
                                timeout_keep_alive=5, http=header_timeout_protocol(read_timeout))
        server = _server(config, app.state.engine, shutdown_timeout)
        sock.listen(128)
        print(f"minipaged serve: {name} on http://{host if ':' not in host else f'[{host}]'}:"
              f"{sock.getsockname()[1]} ({torch.get_num_threads()} torch threads)", flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
