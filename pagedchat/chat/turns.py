"""Token ids of the next turn, without re-tokenizing the history.

The prompt for a new user message is the path's stored token ids plus the template-rendered suffix for
the new message. The suffix is found by rendering the conversation as text with the new message and
cutting off the text the stored ids already decode to. For ChatML and every template that renders earlier
turns the same way whatever follows, that gives exactly the ids a full render would give. For templates
that rewrite earlier turns (e.g. dropping old reasoning), the history keeps the ids the model really saw
and only the template's end-of-turn glue plus the rendered new turn are appended.
"""

from __future__ import annotations

import hashlib

from pagedchat.chat.tree import Node
from pagedchat.errors import UserError

_PROBE_USER, _PROBE_REPLY = "PAGEDCHAT_PROBE_USER", "PAGEDCHAT_PROBE_REPLY"


class Templater:
    def __init__(self, tokenizer, end_token_ids=(), template_kwargs: dict | None = None, model: str = "the model"):
        if tokenizer is None:
            raise UserError(f"{model} has no tokenizer: chat needs one")
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{model} has no chat template; set chat_template in models.toml")
        self.tok = tokenizer
        self.end_ids = set(end_token_ids)
        self.kwargs = dict(template_kwargs or {})

    def takes(self, name: str) -> bool:
        """Whether the chat template reads this variable (e.g. enable_thinking)."""
        template = self.tok.chat_template
        return name in (template if isinstance(template, str) else repr(template))

    # -- primitives -----------------------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **self.kwargs)
        except Exception as e:  # jinja errors raised by the template itself (e.g. "roles must alternate")
            raise UserError(f"the chat template rejected this conversation: {str(e).splitlines()[0]}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def content(self, node: Node) -> str:
        """What the template is given as this message's content. For a reply that is the decoded ids
        (minus the end-of-turn token the template adds itself), so the render matches what the model saw."""
        if node.role != "assistant":
            return node.text
        ids = list(node.token_ids)
        while ids and ids[-1] in self.end_ids:
            ids.pop()
        return self.decode(ids)

    def messages(self, path: list[Node]) -> list[dict]:
        return [{"role": n.role, "content": self.content(n)} for n in path]

    # -- turns ----------------------------------------------------------------------------------------------
    def system_tokens(self, text: str) -> list[int]:
        """The system message alone; [] when the template cannot render it without a user turn (the first
        user node then carries it)."""
        try:
            return self.encode(self.render([{"role": "system", "content": text}], add_generation_prompt=False))
        except UserError:
            return []

    def user_turn_tokens(self, path: list[Node], user_text: str) -> list[int]:
        """Ids to append to the path's ids for a new user message, ending with the assistant header."""
        if path and path[-1].role == "user":
            raise UserError("the head is a user message that has no reply yet: /regen answers it")
        done = self.decode([t for n in path for t in n.token_ids])
        full = self.render(self.messages(path) + [{"role": "user", "content": user_text}], True)
        if full.startswith(done):
            return self.encode(full[len(done):])
        if not any(n.role == "assistant" for n in path):
            return self.encode(full[_common_prefix(done, full):])
        return self.encode(self._closing_glue(done) + self._new_turn(user_text))

    def compacted_turn(self, kept: list[Node], user_text: str) -> tuple[list[int], list[int]]:
        """(prefix ids, new-turn ids) of a conversation rendered afresh from the kept nodes (the system
        message and the newest turns) plus a new user message: what a branch that outgrew the context sends
        instead of its whole history. Rendered as a whole so the template's first-turn rules (BOS, a system
        prompt folded into the first user turn) apply to the new first turn."""
        full = self.render(self.messages(kept) + [{"role": "user", "content": user_text}], True)
        try:
            done = self.render(self.messages(kept), False) if kept else ""
        except UserError:   # a template that cannot render a system message alone
            done = ""
        cut = len(done) if full.startswith(done) else _common_prefix(done, full)
        return self.encode(full[:cut]), self.encode(full[cut:])

    def _closing_glue(self, done: str) -> str:
        """What the template puts after a reply's content that the model did not generate itself."""
        probe = self.render([{"role": "user", "content": _PROBE_USER},
                             {"role": "assistant", "content": _PROBE_REPLY}], False)
        close = probe[probe.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        for k in range(len(close), 0, -1):
            if done.endswith(close[:k]):
                return close[k:]
        return close

    def _new_turn(self, user_text: str) -> str:
        before = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        head = self.render(before, False)
        full = self.render(before + [{"role": "user", "content": user_text}], True)
        return full[_common_prefix(head, full):]

    def fingerprint(self) -> dict:
        template = self.tok.chat_template if isinstance(self.tok.chat_template, str) else repr(self.tok.chat_template)
        return {"vocab_size": len(self.tok), "end_token_ids": sorted(self.end_ids),
                "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16]}


class TextOnlyTemplater:
    """Templater's stand-in for a remote model with no local tokenizer (--server, chat completions only):
    the server renders the messages, so nodes keep their text and no token ids. Such a session says so in
    its fingerprint, and the local engine refuses it (it has no ids to continue from)."""

    end_ids: set = set()

    def __init__(self):
        self.kwargs: dict = {}

    def takes(self, name: str) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return []

    def system_tokens(self, text: str) -> list[int]:
        return []

    def user_turn_tokens(self, path: list[Node], user_text: str) -> list[int]:
        if path and path[-1].role == "user":
            raise UserError("the head is a user message that has no reply yet: /regen answers it")
        return []

    def compacted_turn(self, kept: list[Node], user_text: str) -> tuple[list[int], list[int]]:
        return [], []

    def fingerprint(self) -> dict:
        return {"history": "text"}


def _common_prefix(a: str, b: str) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k
