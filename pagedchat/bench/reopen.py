"""`pagedchat bench chat --reopen`: a saved session reopened after a restart, with and without the disk tier.

For each history length: a first engine answers the history (kept pinned, as a chat turn is), saves it
(write-through to the disk tier) and closes its tiers; it then answers each message from the pinned history,
as the never-restarted process would (the reference replies). Then, alternately, a fresh engine with the disk tier and a fresh engine with
`kv_disk=0` answer that same message after the history: time to first token and the reply. A fresh engine
stands for the new process: its pool and RAM tier are empty, and the disk folder is all it shares with the
first one (the model weights are loaded once and shared, which a new process would have to load again: that
load is the same with and without the disk tier, so it is left out of both). The CLI test
`test_run_session_reopened_in_a_new_process_hits_disk` runs the same path across real processes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pagedchat.bench.chat import _Tokens, _finish, _median, _pinned_history
from pagedchat.errors import UserError


def run_reopen_bench(model_path: Path, model_name: str, histories: tuple[int, ...], message_tokens: int = 64,
                     reply_tokens: int = 16, repeats: int = 3, block_size: int = 16, device: str = "cpu",
                     dtype: str = "auto", seed: int = 0, threads: int | None = None) -> dict:
    import torch

    from pagedchat.bench.common import machine_description
    from pagedchat.engine import Engine, EngineConfig, SamplingParams
    from pagedchat.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(str(model_path), device, dtype, show_progress=False)
    longest = max(histories) + message_tokens + 2 * reply_tokens + 4
    if longest > loaded.max_model_len:
        raise UserError(f"history {max(histories)} + message + reply needs {longest} positions; the model has "
                        f"{loaded.max_model_len}")
    fresh = _Tokens(loaded.spec.vocab_size, seed)
    reply = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-kv-") as kv_dir:
        def engine(kv_disk: int) -> Engine:
            config = EngineConfig(model=str(model_path), device=device, dtype=dtype, block_size=block_size,
                                  num_blocks=-(-longest // block_size) + 8, kv_disk=kv_disk, kv_dir=kv_dir)
            return Engine(config, loaded=loaded, show_progress=False)

        def answer(e: Engine, prompt: list[int], parent=None):
            out = _finish(e, e.add_request(prompt, reply, parent=parent))
            return out.ttft_s, out.outputs[0].token_ids, out.disk_hit_tokens

        warm = engine(0)
        answer(warm, fresh(message_tokens))   # first calls of each shape allocate
        for history in sorted(histories):
            first = engine(1 << 40)
            handle = _pinned_history(first, fresh(history - reply_tokens), reply_tokens)
            first.persist([handle])                                   # the session save, then exit
            first.close()
            # The never-restarted process goes on from its pinned history: the reference replies. (After
            # close() the engine writes nothing more, so the messages stay new to the disk folder.)
            messages = [handle.token_ids + fresh(message_tokens) for _ in range(repeats)]
            references = [answer(first, m, parent=handle)[1] for m in messages]
            disk, plain = [], []
            for message, reference in zip(messages, references):
                # alternating, so load drift on a shared machine hits both alike
                for runs, kv_disk in ((disk, 1 << 40), (plain, 0)):
                    e = engine(kv_disk)
                    ttft, ids, hits = answer(e, message)
                    e.close()
                    runs.append((ttft, ids == reference, hits))
            row = {"history": history, "ttft_disk_s": _median([t for t, _, _ in disk]),
                   "ttft_reprefill_s": _median([t for t, _, _ in plain]),
                   "disk_hit_tokens": min(h for _, _, h in disk),
                   "identical_to_never_restarted": all(same for _, same, _ in disk + plain)}
            row["speedup"] = row["ttft_reprefill_s"] / row["ttft_disk_s"]
            rows.append(row)
            print(f"pagedchat bench: reopen {row}", file=sys.stderr, flush=True)  # partial results on a slow box
    at4k = [r for r in rows if r["history"] == 4096]
    return {"benchmark": "chat-reopen", "model": model_name, "device": device, "machine": machine_description(),
            "block_size": block_size, "message_tokens": message_tokens, "reply_tokens": reply_tokens,
            "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows,
            "speedup_at_4k": at4k[0]["speedup"] if at4k else None}


def print_reopen_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = [[t["history"], t["ttft_disk_s"] * 1000, t["ttft_reprefill_s"] * 1000, t["speedup"],
             t["disk_hit_tokens"], "yes" if t["identical_to_never_restarted"] else "NO"] for t in r["rows"]]
    print_table(f"Reopened session, first turn: {r['model']} on {r['device']} — a {r['message_tokens']}-token "
                f"message after the saved history", ["history", "disk tier TTFT ms", "re-prefill TTFT ms",
                                                     "speedup", "KV from disk (tokens)", "same reply"],
                rows, caption=r["machine"])
