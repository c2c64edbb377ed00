"""`pagedchat bench chat --reopen` / `--reopen --processes` / `--serve-restart`: KV that outlives the process.

--reopen: for each history length a first engine answers the history (kept pinned, as a chat turn is), saves
it (write-through to the disk tier) and closes; an engine without a disk tier answers the same history, kept
pinned, and then each message from it, as the never-restarted process would (the reference replies). Then, alternately, a fresh engine with
the disk tier and a fresh engine with `kv_disk=0` answer that same message after the history: time to first
token and the reply. A fresh engine stands for the new process: its pool and RAM tier are empty, and the disk
folder is all it shares with the first one (the weights are loaded once and shared; a new process would load
them again, the same with and without the disk tier, so that load is left out of both).

--reopen --processes: the same across real `pagedchat run --session` processes (the outside check's flow).

--serve-restart: the first request after a `pagedchat serve` restart under a shared system prompt.
"""

from __future__ import annotations

import json
import random
import subprocess
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
            history_ids = fresh(history - reply_tokens)
            first = engine(1 << 40)
            first.persist([_pinned_history(first, history_ids, reply_tokens)])   # the session save, then exit
            first.close()
            # The never-restarted process goes on from its pinned history: the reference replies, from an engine
            # holding the same history pinned and no disk tier (so the messages stay new to the disk folder).
            alive = engine(0)
            handle = _pinned_history(alive, history_ids, reply_tokens)
            messages = [handle.token_ids + fresh(message_tokens) for _ in range(repeats)]
            references = [answer(alive, m, parent=handle)[1] for m in messages]
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

    processes = r["benchmark"] == "chat-reopen-processes"
    same = "identical_to_reprefill" if processes else "identical_to_never_restarted"
    rows = [[t["history"], t["ttft_disk_s"] * 1000, t["ttft_reprefill_s"] * 1000, t["speedup"],
             t["disk_hit_tokens"], "yes" if t[same] else "NO"] for t in r["rows"]]
    where = "new `pagedchat run` processes" if processes else "a fresh engine"
    print_table(f"Reopened session, first turn in {where}: {r['model']} on {r['device']} — a "
                f"{r['message_tokens']}-token message after the saved history",
                ["history", "disk tier TTFT ms", "re-prefill TTFT ms", "speedup", "KV from disk (tokens)",
                 "same reply as " + ("--kv-disk 0" if processes else "never restarted")], rows, caption=r["machine"])


# -- across real processes ----------------------------------------------------------------------------------
def run_reopen_process_bench(model_path: Path, model_name: str, histories: tuple[int, ...],
                             message_tokens: int = 64, reply_tokens: int = 16, repeats: int = 3, seed: int = 0,
                             threads: int | None = None) -> dict:
    """The outside check's flow, timed: `pagedchat run --session S` makes a session of about `history`
    tokens, then each new process continues it with `--json`, alternately with the disk tier and with
    `--kv-disk 0` (the session file is put back before each, so every one continues the same session). TTFT
    is the `--json` timing.ttft_s (model loading, the same in both, is outside it); the replies must match."""
    import os
    import shutil

    from pagedchat.bench.common import machine_description

    words = _Words(model_path, seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-reopen-") as tmp:
        home = Path(tmp)
        env = dict(os.environ, XDG_CACHE_HOME=str(home / "cache"), XDG_DATA_HOME=str(home / "data"))

        def run(text: str, *flags: str) -> dict:
            cmd = [sys.executable, "-c", "from pagedchat.cli import main; main()", "run", "-m", str(model_path),
                   "--session", "bench", "-t", "0", "--max-tokens", str(reply_tokens),
                   *(["--threads", str(threads)] if threads else []), "--json", *flags, text]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise UserError(f"pagedchat run failed: {proc.stderr.strip().splitlines()[-1:]}")
            return json.loads(proc.stdout)

        for history in sorted(histories):
            shutil.rmtree(home, ignore_errors=True)
            run(words(history))                                       # process 1: the session, saved
            shutil.copytree(home / "data", home / "saved")
            disk, plain = [], []
            for i in range(repeats):
                message = words(message_tokens)
                arms = ((disk, ()), (plain, ("--kv-disk", "0")))
                for runs, flags in arms if i % 2 == 0 else arms[::-1]:   # alternating: load drift hits both
                    shutil.rmtree(home / "data")
                    shutil.copytree(home / "saved", home / "data")
                    out = run(message, *flags)
                    runs.append(out)
            row = {"history": history, "prompt_tokens": disk[0]["usage"]["prompt_tokens"],
                   "ttft_disk_s": _median([o["timing"]["ttft_s"] for o in disk]),
                   "ttft_reprefill_s": _median([o["timing"]["ttft_s"] for o in plain]),
                   "disk_hit_tokens": min(o["kv"]["disk_hit_tokens"] for o in disk),
                   "identical_to_reprefill": all(d["outputs"][0]["token_ids"] == p["outputs"][0]["token_ids"]
                                                 for d, p in zip(disk, plain))}
            row["speedup"] = row["ttft_reprefill_s"] / row["ttft_disk_s"]
            rows.append(row)
            print(f"pagedchat bench: reopen (processes) {row}", file=sys.stderr, flush=True)
    at4k = [r for r in rows if r["history"] == 4096]
    return {"benchmark": "chat-reopen-processes", "model": model_name, "device": "cpu",
            "machine": machine_description(), "message_tokens": message_tokens, "reply_tokens": reply_tokens,
            "repeats": repeats, "threads": threads, "rows": rows,
            "speedup_at_4k": at4k[0]["speedup"] if at4k else None}


# -- a serve restart under a shared system prompt --------------------------------------------------------------
def run_serve_restart_bench(model_path: Path, model_name: str, system_lengths: tuple[int, ...],
                            user_tokens: int = 32, repeats: int = 2, seed: int = 0,
                            threads: int | None = None) -> dict:
    """`pagedchat serve` answers one request under a long system prompt and is stopped (SIGTERM, a clean
    shutdown); a new server on the same cache folder answers the next user's request under the same system
    prompt: its TTFT (streamed, client side) and cached_tokens, with the disk tier against `--kv-disk 0`.
    The arms alternate; each run has its own cache folder."""
    from pagedchat.bench.common import machine_description

    words = _Words(model_path, seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-restart-") as tmp:
        for system_tokens in sorted(system_lengths):
            rows.append(_restart_row(model_path, words, system_tokens, user_tokens, repeats, threads, Path(tmp)))
            print(f"pagedchat bench: serve restart {rows[-1]}", file=sys.stderr, flush=True)
    return {"benchmark": "serve-restart", "model": model_name, "device": "cpu", "machine": machine_description(),
            "user_tokens": user_tokens, "repeats": repeats, "threads": threads, "rows": rows}


def _restart_row(model_path: Path, words, system_tokens: int, user_tokens: int, repeats: int,
                 threads: int | None, tmp: Path) -> dict:
    import os

    from pagedchat.bench.serve import SweepParams

    system = words(system_tokens)
    params = SweepParams(threads=threads or 0, pool_blocks=-(-(system_tokens + 4 * user_tokens) // 16) + 32)
    arms = {"disk": ("--kv-ram", "0", "--kv-disk", "1GiB"), "plain": ("--kv-ram", "0", "--kv-disk", "0")}
    runs: dict[str, list[dict]] = {"disk": [], "plain": []}
    for i in range(repeats):
        users = [words(user_tokens), words(user_tokens)]
        for arm in ("disk", "plain") if i % 2 == 0 else ("plain", "disk"):   # load drift hits both
            name = f"{system_tokens}-{arm}-{i}"
            env = dict(os.environ, XDG_CACHE_HOME=str(tmp / f"cache-{name}"))
            served = [_serve_one(model_path, params, arms[arm], env, tmp, f"{name}-{n}", system, user)
                      for n, user in enumerate(users)]                      # the second one is after the restart
            runs[arm].append(served[1])
    disk, plain = runs["disk"], runs["plain"]
    row = {"system_tokens": system_tokens, "prompt_tokens": disk[0]["prompt_tokens"],
           "ttft_disk_s": _median([r["ttft_s"] for r in disk]), "ttft_plain_s": _median([r["ttft_s"] for r in plain]),
           "cached_tokens_disk": min(r["cached_tokens"] for r in disk),
           "cached_tokens_plain": max(r["cached_tokens"] for r in plain),
           "identical": all(d["text"] == p["text"] for d, p in zip(disk, plain))}
    row["speedup"] = row["ttft_plain_s"] / row["ttft_disk_s"]
    return row


def _serve_one(model_path: Path, params, tiers: tuple[str, ...], env: dict, log_dir: Path, name: str,
               system: str, user: str) -> dict:
    """Start a server, stream one greedy chat request through it, stop the server (cleanly)."""
    import time

    import httpx

    from pagedchat.bench.serve import SERVED_NAME, ServerProcess

    server = ServerProcess(model_path, "paged", params, log_dir, tiers, env, name)
    try:
        url = server.wait_ready()
        body = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        start, ttft, text, usage = time.perf_counter(), None, "", {}
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or []:
                    content = choice.get("delta", {}).get("content") or ""
                    if ttft is None and (content or choice.get("finish_reason")):   # not the opening role chunk
                        ttft = time.perf_counter() - start
                    text += content
                usage = chunk.get("usage") or usage
        return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
    finally:
        server.stop()


def print_restart_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = [[t["system_tokens"], t["ttft_disk_s"] * 1000, t["ttft_plain_s"] * 1000, t["speedup"],
             t["cached_tokens_disk"], t["cached_tokens_plain"], "yes" if t["identical"] else "NO"] for t in r["rows"]]
    print_table(f"First request after a `pagedchat serve` restart under a shared system prompt: {r['model']}",
                ["system prompt tokens", "disk tier TTFT ms", "--kv-disk 0 TTFT ms", "speedup",
                 "cached_tokens (disk)", "cached_tokens (--kv-disk 0)", "same reply"], rows, caption=r["machine"])


class _Words:
    """Seeded random text of about n tokens in the model's own tokenizer (the session and its messages)."""

    def __init__(self, model_path: Path, seed: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
        vocab = sorted(w for w in self.tokenizer.get_vocab() if w.isalpha() and w.isascii())
        if not vocab:
            raise UserError(f"the tokenizer of {model_path} has no plain word pieces to build messages from")
        self.vocab, self.rng = vocab, random.Random(seed)

    def __call__(self, n: int) -> str:
        text = " ".join(self.rng.choice(self.vocab) for _ in range(n))   # a word is at least one token
        offsets = self.tokenizer.encode(text).offsets
        return text if len(offsets) <= n else text[:text.rfind(" ", 0, offsets[n][0] + 1)]
