"""A server in a thread of the test process (the model loaded once), and readers of its answers."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from minipaged import LLM
from minipaged.serving import build_app


class ThreadServer:
    """``build_app(llm, ...)`` served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, llm: LLM | None = None, **app_args) -> None:
        self.llm = llm or LLM("tiny", scheduler="v0", num_gpu_blocks=96, max_model_len=256)
        self.app = build_app(self.llm, **app_args)
        self.engine = self.app.state.engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def sse_events(response: httpx.Response) -> list:
    """The data of each server-sent event, parsed; ``"[DONE]"`` kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_samples(url: str) -> dict[tuple, float]:
    """{(sample name, frozenset of labels without model_name): value} from /metrics, parsed."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metric_types(url: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
