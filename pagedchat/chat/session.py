"""A chat session: its conversation tree, where the head is, which model and settings it was made with.

The JSON form (what sessions/NAME.json holds) records everything needed to resume token-exactly. Pins
(engine handles of branch heads) are runtime only: after a reload the prefix cache serves what it still holds.
`revision` counts the saves: a writer whose copy is older than the file's (the same session open in the REPL
and in a browser) is told so instead of overwriting (store.py).
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
    revision: int = 0                   # the saved copy this one is based on (0: never saved)
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
                "revision": self.revision, "nodes": self.tree.to_list()}

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
        revision = data.get("revision", 0)
        if not isinstance(revision, int) or isinstance(revision, bool) or revision < 0:
            raise ValueError("revision must be a count")
        return cls(name=name or data.get("name") or "", model=str(data.get("model") or ""),
                   model_path=str(data.get("model_path") or ""), fingerprint=data.get("fingerprint") or {},
                   system=system, settings=settings, created=str(data.get("created") or now_iso()),
                   updated=str(data.get("updated") or now_iso()), head=head, last_fork=last_fork, tree=tree,
                   revision=revision)


def rebase(mine: Session, saved: Session) -> dict[int, int]:
    """Lay the nodes `mine` added since it was read onto `saved`, a newer copy another writer saved, in place:
    `mine` becomes saved's tree plus its own new nodes (fresh ids), its head, last fork and pins following
    them, at saved's revision. Nothing of either writer is lost. Returns {old id: new id} of the moved nodes.
    Raises ValueError when `saved` lacks a node one of mine answers (not the same conversation any more)."""
    tree, moved = saved.tree, {}
    for node in sorted(mine.tree.nodes.values(), key=lambda n: n.id):
        twin = tree.nodes.get(node.id)
        if twin is not None and (twin.created, twin.role, twin.token_ids) == (node.created, node.role, node.token_ids):
            continue
        parent = moved.get(node.parent, node.parent)
        if parent is not None and parent not in tree:
            raise ValueError(f"the saved copy has no node #{parent}")
        fields = {k: v for k, v in node.to_dict().items() if k not in ("id", "parent", "role", "text", "token_ids")}
        if node.context is not None:
            fields["context"] = {**node.context, "dropped": [moved.get(i, i) for i in node.context["dropped"]]}
        moved[node.id] = tree.add(parent, node.role, node.text, node.token_ids, **fields).id
    follow = lambda i: moved.get(i, i)   # noqa: E731
    mine.tree, mine.revision = tree, saved.revision
    mine.head = follow(mine.head) if mine.head is not None else None
    mine.last_fork = [follow(i) for i in mine.last_fork] if any(i in moved for i in mine.last_fork) else saved.last_fork
    mine.handles = {follow(i): h for i, h in mine.handles.items() if follow(i) in tree}
    mine.settings = {**saved.settings, **{k: v for k, v in mine.settings.items() if k in mine.set_keys}}
    return moved
