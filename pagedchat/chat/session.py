"""A chat session: its conversation tree, where the head is, which model and settings it was made with.

The JSON form (what sessions/NAME.json holds) records everything needed to resume token-exactly. Pins
(engine handles of branch heads) are runtime only: after a reload the prefix cache serves what it still holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedchat.chat.tree import Node, Tree, now_iso
from pagedchat.errors import UserError

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith(".json"):
        raise UserError(f"invalid session name {name!r}: use letters, digits, '.', '_' or '-' (at most 100, "
                        f"starting with a letter or digit)")
    return name


@dataclass
class Session:
    name: str
    model: str = ""                     # models.toml name (or the path given to -m)
    model_path: str = ""
    fingerprint: dict = field(default_factory=dict)   # tokenizer identity: token ids only mean something with it
    system: str | None = None           # system prompt for new conversations (roots) in this session
    settings: dict = field(default_factory=dict)      # sampling overrides set with /set
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    head: int | None = None
    last_fork: list[int] = field(default_factory=list)  # node ids of the newest /fork's variants (for /pick)
    tree: Tree = field(default_factory=Tree)
    handles: dict = field(default_factory=dict, repr=False)  # node id -> pinned engine Branch (not saved)
    set_keys: set = field(default_factory=set, repr=False)   # settings changed with /set in this run
    compact_next: bool = field(default=False, repr=False)    # /compact: the next message drops old turns

    # -- the current branch ---------------------------------------------------------------------------------
    def path(self, node_id: int | None = ...) -> list[Node]:
        return self.tree.path(self.head if node_id is ... else node_id)

    def head_node(self) -> Node | None:
        return self.tree.get(self.head) if self.head is not None else None

    def node(self, node_id: int) -> Node:
        if node_id not in self.tree:
            raise UserError(f"no node #{node_id} in session {self.name} (see /tree)")
        return self.tree.get(node_id)

    @property
    def num_messages(self) -> int:
        return sum(1 for n in self.tree.nodes.values() if n.role != "system")

    # -- JSON -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "name": self.name, "model": self.model, "model_path": self.model_path,
                "fingerprint": self.fingerprint, "system": self.system, "settings": self.settings,
                "created": self.created, "updated": self.updated, "head": self.head, "last_fork": self.last_fork,
                "nodes": self.tree.to_list()}

    @classmethod
    def from_dict(cls, data: dict, name: str | None = None) -> "Session":
        """Raises ValueError with a short reason when the data is not a valid session."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"unknown format version {version!r}")
        tree = Tree.from_list(data.get("nodes", []))
        head = data.get("head")
        if head is not None and head not in tree:
            raise ValueError(f"head {head!r} is not a node")
        settings = data.get("settings") or {}
        if not isinstance(settings, dict):
            raise ValueError("settings must be an object")
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("system must be a string")
        last_fork = [i for i in data.get("last_fork") or [] if i in tree]
        return cls(name=name or data.get("name") or "", model=str(data.get("model") or ""),
                   model_path=str(data.get("model_path") or ""), fingerprint=data.get("fingerprint") or {},
                   system=system, settings=settings, created=str(data.get("created") or now_iso()),
                   updated=str(data.get("updated") or now_iso()), head=head, last_fork=last_fork, tree=tree)
