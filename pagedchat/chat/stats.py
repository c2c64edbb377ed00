"""The numbers the chat shows: a turn's stats line (prompt new + cached, TTFT, tok/s, blocks), what a reply node
keeps of them, and the pool report of /stats. Plain dicts: render.py draws them, `run --session --json` prints
them."""

from __future__ import annotations

NODE_KEYS = ("ttft_s", "tokens_per_s", "prompt_new", "prompt_cached", "completion_tokens", "blocks_used")


def turn_stats(backend, prompt: list[int], out, capped: int | None, n: int) -> dict:
    completion = sum(len(v.token_ids) for v in out.outputs)
    ttft, total = out.ttft_s, out.total_s
    decode_s = (total - ttft) if total is not None and ttft is not None else None
    decoded = completion - len(out.outputs)
    pool = backend.pool_stats()
    remote = backend.describe()
    size = len(prompt)
    if remote is not None and not prompt:   # text only (no local tokenizer): the server counted the prompt
        size = remote["prompt_tokens"] or 0
    return {"ttft_s": ttft, "total_s": total,
            "tokens_per_s": decoded / decode_s if decode_s and decoded > 0 else None,
            "completion_tokens": completion, "variants": len(out.outputs),
            "variants_requested": n,
            "prompt_tokens": size, "prompt_token_ids": list(prompt) or None, "prompt_cached": out.prefix_hit_tokens,
            "prompt_new": size - out.prefix_hit_tokens,
            "context_tokens": size + max((len(v.token_ids) for v in out.outputs), default=0),
            "max_context": backend.max_model_len, "capped_max_tokens": capped,
            "blocks_used": pool.used, "num_blocks": pool.num_blocks, "block_size": pool.block_size,
            **({"remote": remote} if remote is not None else {})}


def node_stats(stats: dict) -> dict:
    """What a reply node keeps of its turn's stats (saved with the session)."""
    return {k: stats[k] for k in NODE_KEYS}


def pool_report(backend, sessions: dict, last_turn: dict | None) -> dict:
    """/stats: the pool, the blocks each resident session holds, the last turn."""
    st = backend.stats()
    pool = st.pool_stats
    per_session = {name: {"nodes": len(s.tree), "pinned_heads": sum(1 for h in s.handles.values() if h.is_pinned),
                          "blocks": backend.blocks_held(s.handles.values())}
                   for name, s in sessions.items()}
    return {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "kv_dtype": pool.kv_dtype,
            "used": pool.used, "free": pool.free,
            "cached": pool.cached, "shared": pool.shared, "peak_used": pool.peak_used,
            "prefix_hit_tokens": pool.prefix_hit_tokens, "prefix_query_tokens": pool.prefix_query_tokens,
            "prefix_hit_rate": pool.prefix_hit_rate, "cow_copies": pool.cow_copies, "pinned": st.pinned,
            "ram_hit_tokens": pool.ram_hit_tokens, "disk_hit_tokens": pool.disk_hit_tokens,
            "pinned_blocks": st.pinned_blocks, "preemptions": st.preemptions, "sessions": per_session,
            "last_turn": last_turn, "spec": st.spec,
            **({"remote": remote} if (remote := backend.describe()) is not None else {})}
