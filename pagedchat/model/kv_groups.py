"""How a model's layers map onto the KV pool's layer groups (used by engine/core/window_groups.py and the runner).

A block id always means `num_slots` layers x block_size tokens, whichever group holds it. Group 0 holds
every global (full-attention) layer; window layers fill groups of the same size, so each group has its own
block table per sequence over the one pool, and window groups can give blocks back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    """Per layer: its group and its slot (which of the S cache tensors it reads and writes)."""
    num_slots: int                        # S: layers per group = cache tensors per K and V
    layer_group: tuple[int, ...]          # group of each layer (0 = the global group of block_table)
    layer_slot: tuple[int, ...]
    num_window_groups: int                # groups 1..num_window_groups are window groups
    window: int | None


def plan_groups(windows: list[int | None]) -> KVGroups:
    """Group 0 holds every global layer (S = their number); window layers fill groups of S slots (the last
    one may leave slots unused: that waste is bounded by the window)."""
    global_layers = [i for i, w in enumerate(windows) if not w]
    window_layers = [i for i, w in enumerate(windows) if w]
    if not global_layers or not window_layers or len({w for w in windows if w}) != 1:
        n = len(windows)  # one group: every layer keeps every block (windows apply in attention only)
        return KVGroups(n, (0,) * n, tuple(range(n)), 0, None)
    size = len(global_layers)
    group, slot = [0] * len(windows), [0] * len(windows)
    for rank, layer in enumerate(global_layers):
        group[layer], slot[layer] = 0, rank
    for rank, layer in enumerate(window_layers):
        group[layer], slot[layer] = 1 + rank // size, rank % size
    return KVGroups(size, tuple(group), tuple(slot), -(-len(window_layers) // size), windows[window_layers[0]])
