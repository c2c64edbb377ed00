"""`pagedchat bench memory` sliding-window rows: a Gemma-3-shaped model (5 window layers : 1 global, window
1024) whose window groups release blocks, against the same model holding every block (no release).

Both sides are the real Engine (BlockPool, Scheduler, WindowTables) with the model runner replaced by
bookkeeping, given the same KV budget in bytes. A pool block holds S layers x block_size tokens: S = 1 with
layer groups (one global group, five window groups), S = 6 without (every layer in every block), so the
budget is counted in one-layer blocks ("layer-blocks") and blocks held are compared in that unit.

  - blocks held: one chat at CONTEXT tokens, pinned (as the REPL keeps a session);
  - concurrency admitted: chats of CONTEXT tokens are added one by one and kept pinned until the first one
    has to give its blocks back: the number of chats the budget holds at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

LAYERS = ("sliding",) * 5 + ("full",)


@dataclass
class WindowParams:
    window: int = 1024
    contexts: tuple[int, ...] = (8192, 32768)
    budget_chats: int = 8             # the budget: this many full-attention chats at the largest context
    block_size: int = 16
    max_batched_tokens: int = 2048


def _sim(p: WindowParams, release: bool, layer_blocks: int, max_len: int):
    from pagedchat.bench.memory import PagedSim
    from pagedchat.model.kv_groups import plan_groups

    windows = [p.window if t == "sliding" else None for t in LAYERS]
    groups = plan_groups(windows) if release else None
    slots = groups.num_slots if groups else len(LAYERS)
    sim = PagedSim(layer_blocks // slots, p.block_size, 10**6, p.max_batched_tokens, max_len, prefix_cache=False,
                   kv_groups=groups)
    return sim, slots


def _chat(sim, fresh, context: int) -> None:
    from pagedchat.engine import SamplingParams

    sim.engine.add_request([next(fresh) for _ in range(context - 1)],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), keep=True)
    sim.run()


def held_by_one_chat(p: WindowParams, context: int, release: bool) -> int:
    """Layer-blocks one pinned chat of `context` tokens holds."""
    sim, slots = _sim(p, release, 10 * context * len(LAYERS), context + 1)
    _chat(sim, itertools.count(1), context)
    return sim.pool.num_used * slots


def concurrent_chats(p: WindowParams, context: int, release: bool, layer_blocks: int) -> int:
    """Chats of `context` tokens the budget keeps pinned at once (until the first pin must be dropped)."""
    sim, _ = _sim(p, release, layer_blocks, context + 1)
    fresh = itertools.count(1)
    held = 0
    while held < 10_000:
        _chat(sim, fresh, context)
        pins = len(sim.scheduler.pins)
        if pins <= held or sim.failed:
            break
        held = pins
    return held


def run_window_bench(p: WindowParams | None = None) -> dict:
    p = p or WindowParams()
    budget = p.budget_chats * (max(p.contexts) // p.block_size) * len(LAYERS)
    rows = []
    for context in p.contexts:
        held = {r: held_by_one_chat(p, context, r) for r in (True, False)}
        chats = {r: concurrent_chats(p, context, r, budget) for r in (True, False)}
        rows.append({"context": context, "blocks_held_release": held[True], "blocks_held_no_release": held[False],
                     "blocks_held_ratio": held[True] / held[False],
                     "concurrent_chats_release": chats[True], "concurrent_chats_no_release": chats[False],
                     "concurrency_ratio": chats[True] / chats[False] if chats[False] else None})
    return {"layers": "5 sliding-window : 1 global (x1)", "window": p.window, "block_size": p.block_size,
            "budget_layer_blocks": budget, "unit": "one-layer blocks of block_size tokens", "rows": rows}


def print_window_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    print_table(f"sliding window: Gemma-3-shaped (5 window : 1 global, window {r['window']}), budget "
                f"{r['budget_layer_blocks']} one-layer blocks",
                ["context", "blocks held (release)", "blocks held (no release)", "ratio",
                 "chats admitted (release)", "chats admitted (no release)", "ratio"],
                [[x["context"], x["blocks_held_release"], x["blocks_held_no_release"], x["blocks_held_ratio"],
                  x["concurrent_chats_release"], x["concurrent_chats_no_release"], x["concurrency_ratio"]]
                 for x in r["rows"]])
