"""Run the real `pagedchat` entry point in-process and capture what a user would see."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path


def invoke(args: list[str], stdin: str | None = None, capsys=None, monkeypatch=None) -> tuple[int, str, str]:
    from pagedchat.cli import main

    monkeypatch.setattr(sys, "argv", ["pagedchat", *args])
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin) if stdin is not None else _TTY())
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


class _TTY(io.StringIO):
    def isatty(self):
        return True


def read_session(xdg_home: Path, name: str) -> dict:
    """The saved session file, as a test's XDG data folder holds it."""
    return json.loads((xdg_home / "data" / "pagedchat" / "sessions" / f"{name}.json").read_text())
