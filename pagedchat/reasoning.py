"""Reasoning ("thinking") text of models whose templates wrap it in <think>...</think> (Qwen3, DeepSeek-R1,
QwQ and their kin): split from the answer, while it streams and once it is done.

What stays in the conversation: the stored history keeps the reasoning's exact token ids (a branch's next
turn appends to the KV the model already computed, so nothing is re-prefilled). Templates like Qwen3's
drop earlier turns' reasoning when they render a whole conversation; following them would change the
prefix of every turn and re-prefill the history each time. The model still sees the answers it gave; it also
sees its earlier reasoning, which its training may not have shown it. `chat/turns.py` appends each new turn
with the template's own glue, so the new turn itself is rendered exactly as the template says.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def starts_thinking(prompt_text: str) -> bool:
    """A generation prompt that already opened the reasoning (DeepSeek-R1 style: it ends with <think>)."""
    return prompt_text.rstrip().endswith(OPEN)


def split(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole reply; reasoning None when there is none. `thinking`: the reply began
    inside the reasoning (the prompt opened it); a reply with a </think> and no <think> before it did too."""
    close = text.find(CLOSE)
    if not thinking and close >= 0 and OPEN not in text[:close]:
        thinking = True
    stream = ReasoningStream(thinking)
    pieces = stream.feed(text) + stream.flush()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    answer = "".join(t for kind, t in pieces if kind == "answer")
    return (reasoning.strip() if stream.saw_reasoning else None), answer.lstrip("\n") if stream.saw_reasoning else answer


class ReasoningStream:
    """Text deltas in, ("reasoning" | "answer", text) pieces out. A tag split across two deltas is held back
    until it is whole, so no half tag is ever shown."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.saw_reasoning = thinking
        self.started = thinking        # past the first visible characters: a later <think> is just text
        self.pending = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.pending += delta
        out: list[tuple[str, str]] = []
        while self.pending:
            if not self.thinking and not self.started:
                stripped = self.pending.lstrip()
                if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                    break                                   # could still become <think>
                if stripped.startswith(OPEN):
                    self.thinking = self.saw_reasoning = self.started = True
                    self.pending = stripped[len(OPEN):]
                    continue
                self.started = True
            if not self.thinking:
                out.append(("answer", self.pending))
                self.pending = ""
                break
            end = self.pending.find(CLOSE)
            if end >= 0:
                out.append(("reasoning", self.pending[:end]))
                self.pending = self.pending[end + len(CLOSE):]
                self.thinking = False
                continue
            keep = _partial_suffix(self.pending, CLOSE)
            out.append(("reasoning", self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return [(kind, text) for kind, text in out if text]

    def flush(self) -> list[tuple[str, str]]:
        """The reply ended: what was held back is what it is."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        return [("reasoning" if self.thinking else "answer", text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
