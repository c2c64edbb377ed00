"""A conversation tree: every message ever produced in a session, linked to the message it answers.

Nothing is overwritten: regenerate, edit and fork add siblings. Each node keeps the exact token ids the
model saw (user/system nodes: the template-rendered text around the message) or produced (assistant
nodes: the generated ids, end-of-turn token included), so the prompt of any branch is the concatenation of
its path's token ids and is never re-tokenized.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from pagedchat.chat import alternatives

ROLES = ("system", "user", "assistant")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclass
class Node:
    id: int
    parent: int | None
    role: str
    text: str
    token_ids: list[int]
    interrupted: bool = False          # Ctrl-C stopped the reply: the tokens are the part generated
    variant: int | None = None         # 1-based index among the variants of one /fork
    finish_reason: str | None = None   # stop | length | abort (assistant nodes)
    created: str = field(default_factory=now_iso)
    stats: dict | None = None          # ttft_s, tokens_per_s, prompt_new, prompt_cached, ...
    # A user message whose prompt dropped the oldest turns to fit the context: {"dropped": [node ids],
    # "prefix_ids": [the re-rendered ids that stand for the whole path above this node]}. None: the prompt
    # was the path's own ids.
    context: dict | None = None
    # With /logprobs on, per reply token: [logprob, [[token_id, logprob], ...]] (chat/alternatives.py).
    logprobs: list | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Node":
        if not isinstance(data, dict):
            raise ValueError("a node must be an object")
        missing = [k for k in ("id", "parent", "role", "text", "token_ids") if k not in data]
        if missing:
            raise ValueError(f"node without {missing[0]!r}")
        node = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        if not isinstance(node.id, int) or isinstance(node.id, bool) or node.id < 1:
            raise ValueError(f"bad node id {node.id!r}")
        if node.parent is not None and not isinstance(node.parent, int):
            raise ValueError(f"node {node.id}: bad parent {node.parent!r}")
        if node.role not in ROLES:
            raise ValueError(f"node {node.id}: unknown role {node.role!r}")
        if not isinstance(node.text, str):
            raise ValueError(f"node {node.id}: text must be a string")
        if not _int_list(node.token_ids):
            raise ValueError(f"node {node.id}: token_ids must be a list of integers")
        if node.context is not None and not (isinstance(node.context, dict) and _int_list(node.context.get("prefix_ids"))
                                             and _int_list(node.context.get("dropped"))):
            raise ValueError(f"node {node.id}: context must hold the lists 'prefix_ids' and 'dropped'")
        if node.logprobs is not None and not (alternatives.is_valid(node.logprobs)
                                              and len(node.logprobs) == len(node.token_ids)):
            raise ValueError(f"node {node.id}: logprobs must hold one [logprob, alternatives] row per token")
        return node


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class Tree:
    def __init__(self, nodes: list[Node] | None = None):
        self.nodes: dict[int, Node] = {}
        self._children: dict[int | None, list[int]] = {None: []}
        for node in sorted(nodes or [], key=lambda n: n.id):
            self._insert(node)

    def _insert(self, node: Node) -> None:
        if node.id in self.nodes:
            raise ValueError(f"duplicate node id {node.id}")
        if node.parent is not None and node.parent not in self.nodes:
            # Ids grow with time, so a parent always has a smaller id: this also rules out cycles.
            raise ValueError(f"node {node.id}: parent {node.parent} does not exist")
        self.nodes[node.id] = node
        self._children.setdefault(node.parent, []).append(node.id)
        self._children.setdefault(node.id, [])

    @property
    def next_id(self) -> int:
        return max(self.nodes, default=0) + 1

    def add(self, parent: int | None, role: str, text: str, token_ids: list[int], **fields) -> Node:
        assert role in ROLES and (parent is None or parent in self.nodes)
        node = Node(self.next_id, parent, role, text, list(token_ids), **fields)
        self._insert(node)
        return node

    def __contains__(self, node_id) -> bool:
        return node_id in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def children(self, node_id: int | None) -> list[Node]:
        return [self.nodes[i] for i in self._children.get(node_id, [])]

    def siblings(self, node_id: int) -> list[Node]:
        """The node and the other nodes with the same parent, oldest first."""
        return self.children(self.nodes[node_id].parent)

    def path(self, node_id: int | None) -> list[Node]:
        """Root-to-node list of nodes (empty for None)."""
        out = []
        while node_id is not None:
            node = self.nodes[node_id]
            out.append(node)
            node_id = node.parent
        return out[::-1]

    def path_tokens(self, node_id: int | None) -> list[int]:
        """The exact ids of the branch ending at node_id, as the model sees them: the path's ids, or from the
        newest node whose prompt dropped older turns, that node's re-rendered prefix and the ids after it."""
        path = self.path(node_id)
        start = max((i for i, n in enumerate(path) if n.context is not None), default=None)
        if start is None:
            return [t for node in path for t in node.token_ids]
        return list(path[start].context["prefix_ids"]) + [t for node in path[start:] for t in node.token_ids]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes.values() if not self._children.get(n.id)]

    def descend(self, node_id: int | None) -> int | None:
        """Follow the newest child down to a leaf: where a branch 'ends' after switching to its middle."""
        while self._children.get(node_id):
            node_id = self._children[node_id][-1]
        return node_id

    def to_list(self) -> list[dict]:
        return [self.nodes[i].to_dict() for i in sorted(self.nodes)]

    @classmethod
    def from_list(cls, items: list) -> "Tree":
        if not isinstance(items, list):
            raise ValueError("nodes must be a list")
        return cls([Node.from_dict(item) for item in items])
