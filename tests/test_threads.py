"""The thread count: the cores this process may use, less the busy ones, at least one."""

from __future__ import annotations

import os

import pytest

from minipaged.cli import main
from minipaged.common import threads

pytestmark = pytest.mark.tooling


def machine(monkeypatch, cores: int, load: float) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize(("cores", "load", "free"), [
    (2, 0.0, 2),   # quiet
    (2, 1.0, 1),   # one core taken by another process
    (2, 0.9, 1),   # nearly one
    (2, 0.3, 2),   # a little noise is not a busy core
    (2, 5.0, 1),   # overloaded: still one thread
    (16, 3.0, 13),
])
def test_free_cores_subtracts_busy_cores_from_the_affinity_set(monkeypatch, cores, load, free):
    machine(monkeypatch, cores, load)
    assert threads.free_cores() == free
    assert threads.choose_threads() == free


def test_affinity_not_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    machine(monkeypatch, 3, 0.0)
    assert threads.free_cores() == 3


def test_requested_wins_over_the_machine(monkeypatch):
    machine(monkeypatch, 2, 2.0)
    assert threads.choose_threads(4) == 4
    with pytest.raises(ValueError):
        threads.choose_threads(0)


def test_apply_threads_sets_torch(monkeypatch):
    import torch

    before = torch.get_num_threads()
    machine(monkeypatch, 2, 1.0)
    try:
        assert threads.apply_threads() == 1
        assert torch.get_num_threads() == 1
        assert threads.apply_threads(2) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("argv", "expected"), [([], 1), (["--threads", "2"], 2)])
def test_generate_uses_the_chosen_threads(monkeypatch, capsys, argv, expected):
    import torch

    before = torch.get_num_threads()
    machine(monkeypatch, 2, 1.0)
    try:
        assert main(["generate", "--prompt", "Hello", "--max-tokens", "2", *argv]) == 0
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
    captured = capsys.readouterr()
    assert f"torch threads: {expected}" in captured.err
    assert captured.out.startswith("Hello")


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_demo_and_serve_accept_threads(monkeypatch, command):
    import minipaged.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "_set_threads", lambda args, quiet=False: seen.setdefault("threads", args.threads))
    monkeypatch.setattr(cli, "_engine_demo", lambda args: None)
    import minipaged.serving

    monkeypatch.setattr(minipaged.serving, "serve", lambda *a, **k: None)
    extra = ["--requests", "5"] if command == "demo" else []
    assert main([command, "--threads", "3", *extra]) == 0
    assert seen["threads"] == 3
