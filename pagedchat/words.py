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
    """A reply cut by max_tokens or the context must not pass for a whole one: a dim [length] after it on a
    terminal. A pipe gets the text alone (scripts read finish_reason from --json)."""
    return " \x1b[2m[length]\x1b[0m" if finish_reason == "length" and _is_terminal() else ""


def _is_terminal() -> bool:
    return sys.stdout.isatty()
