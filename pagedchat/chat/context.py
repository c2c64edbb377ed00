"""What the model sees for a turn: the prompt's token ids (the path's stored ids + the new message's rendered
suffix), fitted into the context window, and the same turn as chat messages for a server that takes no
token-id prompts.

Under `stop` a branch keeps growing until the engine refuses it; under `drop-oldest` the oldest exchanges are
dropped (recorded on the new node, said in a note) once the reply would have too little room.
"""

from __future__ import annotations

from pagedchat.chat.backend import ContextFull
from pagedchat.chat.session import Session
from pagedchat.chat.tree import Node

CONTEXT_LEAD = 64           # prompt tokens put before a sibling reply, so a draft can match its start


def path_with_system(s: Session, templater) -> list[Node]:
    """The head's path; for a conversation that starts now, a system node (reused if one with the same text is
    already a root: all branches under it share its cached blocks). Node id 0 = not yet added."""
    path = s.path()
    if path or not s.system:
        return path
    for root in s.tree.children(None):
        if root.role == "system" and root.text == s.system:
            return [root]
    return [Node(0, None, "system", s.system, templater.system_tokens(s.system))]


def fit(s: Session, templater, path: list[Node], text: str, max_tokens: int, max_len: int, policy: str,
        notes: list[str]):
    """(prompt ids, the new user node's ids, its context record) for a new message after `path`.

    Under `stop` the branch keeps growing (the engine refuses it once it is full). Under `drop-oldest`, once the
    reply would have less room than it needs, the system prompt and the newest turns that fit in half the
    context are rendered afresh with the new message; the dropped turns are said in a note and recorded on the
    new node. Half, not all of it: each drop shifts every later position, so nothing after the system prompt
    can come from the cache; dropping well below the limit lets the next turns append to pinned KV again
    instead of re-rendering every turn."""
    user_ids = templater.user_turn_tokens(path, text)
    history = s.tree.path_tokens(path[-1].id) if path and path[-1].id else [t for n in path for t in n.token_ids]
    prompt = history + user_ids
    limit = max_len - min(max_tokens, max(32, max_len // 4))   # room kept for the reply
    if not s.compact_next and (len(prompt) <= limit or policy == "stop"):
        return prompt, user_ids, None
    s.compact_next = False
    system = [path[0]] if path and path[0].role == "system" else []
    gone = {i for node in path if node.context for i in node.context["dropped"]}
    turns = [node for node in path[len(system):] if node.id not in gone]
    starts = [i for i, node in enumerate(turns) if node.role == "user"]
    for start in starts[1:] + [len(turns)]:        # drop the oldest turns first, one exchange at a time
        prefix, new_ids = templater.compacted_turn(system + turns[start:], text)
        if len(prefix) + len(new_ids) <= max_len // 2:
            break
    if len(prefix) + len(new_ids) >= max_len:
        raise ContextFull(f"the context is full: this message alone needs {len(prefix) + len(new_ids)} "
                          f"tokens and the model takes {max_len}", "send a shorter message")
    dropped = [node.id for node in turns[:start]]
    if not dropped:     # nothing older to drop: the message goes as it is (the engine says if it cannot)
        return prompt, user_ids, None
    notes.append(f"dropped turns #{dropped[0]}-#{dropped[-1]} from the context "
                 f"({len(prompt)} -> {len(prefix) + len(new_ids)} tokens)")
    return prefix + new_ids, new_ids, {"dropped": dropped, "prefix_ids": prefix}


def reply_cap(prompt_len: int, max_tokens: int, max_len: int, policy: str) -> int | None:
    """The max_tokens a reply gets when its own would overrun the context, else None. Under stop a reply
    leaves room for more turns in a small context; drop-oldest makes room when it must."""
    room = max_len - prompt_len
    limit = room if policy == "drop-oldest" else max(room // 2, min(room, 32))
    if room >= 1 and max_tokens > limit:   # room < 1: the engine refuses it (ContextFull)
        return limit
    return None


def as_messages(path: list[Node], text: str | None = None) -> list[dict]:
    """The turn as chat messages (what a server without token-id prompts gets): the path's texts, then the new
    user message."""
    out = [{"role": n.role, "content": n.text} for n in path]
    return out + [{"role": "user", "content": text}] if text is not None else out
