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


# What a terminal acts on instead of showing: the C0 controls but tab and newline (ESC starts the sequences that
# move the cursor, clear the screen or set the window title; CR returns to the start of the line), DEL and the C1
# controls (0x9b is a one-byte CSI). Generated text shown on a terminal carries each as its Unicode control picture
# (ESC as U+241B) or U+FFFD, one character for one, so a reply can never move the cursor or rewrite the screen
# (a small random model's ESC M once pulled a variant's text into the row above). A pipe or a file gets the text as
# generated.
_PICTURES = {**{c: 0x2400 + c for c in range(0x20) if c not in (0x09, 0x0A)}, 0x7F: 0x2421,
             **{c: 0xFFFD for c in range(0x80, 0xA0)}}


def for_terminal(text: str) -> str:
    """`text` with every control character a terminal would act on replaced by a visible one (same length)."""
    return text.translate(_PICTURES)


def for_stdout(text: str) -> str:
    """Generated text as stdout should get it: for_terminal on a terminal, unchanged in a pipe or a file."""
    return for_terminal(text) if _is_terminal() else text
