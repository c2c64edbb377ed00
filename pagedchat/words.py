"""Small wording helpers shared by the command line and the REPL (no heavy imports: `run` starts fast)."""

from __future__ import annotations

import sys


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 session', '2 sessions' (plural given where adding s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def article(word: str) -> str:
    """'an assistant', 'a user'."""
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def cut_mark(finish_reason: str | None) -> str:
    """A reply cut by max_tokens, the context or Ctrl-C must not pass for a whole one: a dim [length] or
    [interrupted] after it on a terminal. A pipe gets the text alone (and a note on stderr; scripts read
    finish_reason from --json)."""
    mark = {"length": "length", "abort": "interrupted"}.get(finish_reason or "")
    return f" \x1b[2m[{mark}]\x1b[0m" if mark and _is_terminal() else ""


def _is_terminal() -> bool:
    return sys.stdout.isatty()
