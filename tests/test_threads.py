"""--threads on every command, PAGEDCHAT_THREADS, the physical-core default, and --version."""

from __future__ import annotations

import pytest
import torch
import typer

from pagedchat import __version__, threads


def _commands(group, path=()):
    for name, command in getattr(group, "commands", {}).items():
        yield from _commands(command, (*path, name)) if hasattr(command, "commands") else [((*path, name), command)]


def test_every_command_takes_threads():
    from pagedchat.cli import app

    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) >= 8
    for path, command in commands:
        assert any("--threads" in p.opts for p in command.params), f"pagedchat {' '.join(path)} has no --threads"


def test_threads_flag_sets_torch_threads(pagedchat_cli, monkeypatch):
    before = torch.get_num_threads()
    try:
        code, _, err = pagedchat_cli("sessions", "list", "--threads", "1")
        assert code == 0, err
        assert torch.get_num_threads() == 1
        code, _, err = pagedchat_cli("sessions", "list", "--threads", "0")
        assert code != 0 and err.count("\n") == 1 and "--threads must be >= 1" in err
    finally:
        torch.set_num_threads(before)


def test_environment_and_default(monkeypatch):
    monkeypatch.setenv(threads.ENV_VAR, "3")
    assert threads.resolve_threads(None) == 3
    assert threads.resolve_threads(2) == 2  # the flag wins
    monkeypatch.setenv(threads.ENV_VAR, "many")
    with pytest.raises(Exception, match="PAGEDCHAT_THREADS='many'"):
        threads.resolve_threads(None)
    monkeypatch.delenv(threads.ENV_VAR)
    assert threads.resolve_threads(None) == threads.physical_cores()
    assert 1 <= threads.physical_cores() <= len(__import__("os").sched_getaffinity(0))


def test_version(pagedchat_cli):
    code, out, _ = pagedchat_cli("--version")
    assert code == 0 and out.strip() == f"pagedchat {__version__}"
