"""`pagedchat bench chat`: what a conversation costs as its history grows.

1. Turn-k TTFT. The history (H tokens) is a pinned branch head; the next turn forks it (`parent=`) so only
   the new message is prefilled. The peer re-prefills the whole history, as a stateless transformers chat
   loop does (`model.generate(history + message, max_new_tokens=1)`). Turn-1 TTFT is the same message with
   no history. Every repetition sends a different message, so nothing but the history can be reused.
2. Fork cost. The same history forked into N variants (SamplingParams(n=N)): blocks copied (the pool's
   copy-on-write counter), extra blocks held, and milliseconds for prefill + fork + first decode, against
   one variant. The peer: `generate(num_return_sequences=N)` expands the history N times.
3. Beam search memory (--beams W): W beams over a fresh 1k/2k-token prompt on the real model, the pool's
   blocks in use after every step against one sequence over the same prompt and against a contiguous
   per-beam cache (W whole histories); the peer's own KV cache after `generate(num_beams=W)` is counted too.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pagedchat.bench.common import percentile
from pagedchat.bench.throughput import FIRST_ID
from pagedchat.errors import UserError

DEFAULT_HISTORIES = (1024, 2048, 4096, 8192)


class _Tokens:
    """Fresh random token ids: no two messages share a block, so only real reuse can hit the cache."""

    def __init__(self, vocab: int, seed: int):
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_chat_bench(model_path: Path, model_name: str, histories: tuple[int, ...] = DEFAULT_HISTORIES,
                   message_tokens: int = 64, reply_tokens: int = 16, variants: int = 8, repeats: int = 3,
                   block_size: int = 16, device: str = "cpu", dtype: str = "auto", seed: int = 0,
                   threads: int | None = None, baseline: bool = True, beams: int = 0,
                   beam_prompts: tuple[int, ...] = (1024, 2048), beam_tokens: int = 64) -> dict:
    import torch

    from pagedchat.bench.common import machine_description
    from pagedchat.engine import Engine, EngineConfig, SamplingParams
    from pagedchat.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    if message_tokens < 1 or reply_tokens < 1 or variants < 2 or repeats < 1 or not histories:
        raise UserError("--message-tokens, --reply-tokens, --repeats must be >= 1 and --variants >= 2")
    longest = max(histories) + message_tokens + reply_tokens + 4
    loaded = load_model(str(model_path), device, dtype, show_progress=False)
    if longest > loaded.max_model_len:
        raise UserError(f"history {max(histories)} + message + reply needs {longest} positions; the model has "
                        f"{loaded.max_model_len}")
    if min(histories) <= reply_tokens:
        raise UserError("every --history must be longer than --reply-tokens")
    per_conversation = -(-longest // block_size)
    config = EngineConfig(model=str(model_path), device=device, dtype=dtype, block_size=block_size,
                          num_blocks=3 * per_conversation + variants * 4 + 16)
    engine = Engine(config, loaded=loaded, show_progress=False)
    fresh = _Tokens(loaded.spec.vocab_size, seed)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(prompt, parent=None) -> tuple[float, int]:
        out = _finish(engine, engine.add_request(prompt, first, parent=parent))
        return out.ttft_s, out.prefix_hit_tokens

    for _ in range(3):   # warm-up: first calls of each shape allocate
        ttft(fresh(message_tokens))
    turn1 = [ttft(fresh(message_tokens))[0] for _ in range(repeats)]
    hf = _HFPeer(model_path, device, dtype) if baseline else None
    hf_turn1 = hf.ttft([fresh(message_tokens) for _ in range(repeats)]) if hf else None

    rows, forks = [], []
    for history in sorted(histories):
        handle = _pinned_history(engine, fresh(history - reply_tokens), reply_tokens)
        assert handle.num_tokens == history
        hits, times, firsts = [], [], []
        for _ in range(repeats):
            # Turn k and a turn 1 side by side: on a shared machine the load drifts, the ratio should not.
            t, hit = ttft(handle.token_ids + fresh(message_tokens), parent=handle)
            times.append(t)
            hits.append(hit)
            firsts.append(ttft(fresh(message_tokens))[0])
        turn1 += firsts
        row = {"history": history, "ttft_s": _median(times), "turn1_ttft_s": _median(firsts),
               "ttft_ratio_vs_turn1": _median(times) / _median(firsts),
               "compute_ratio": compute_ratio(loaded.hf_config, history, message_tokens),
               "prefix_hit_tokens": min(hits), "prefilled_tokens": history + message_tokens - min(hits)}
        if hf:
            row["hf_reprefill_ttft_s"] = hf.ttft([handle.token_ids + fresh(message_tokens) for _ in range(repeats)])
            row["speedup_vs_hf"] = row["hf_reprefill_ttft_s"] / row["ttft_s"]
        rows.append(row)
        forks.append(_fork_cost(engine, handle, fresh, message_tokens, variants, repeats, device, hf))
        engine.release(handle)
    engine.check_invariants()
    result = {
        "model": model_name, "device": device, "machine": machine_description(), "block_size": block_size,
        "message_tokens": message_tokens, "reply_tokens": reply_tokens, "variants": variants, "repeats": repeats,
        "turn1_ttft_s": _median(turn1), "hf_turn1_ttft_s": hf_turn1, "turns": rows, "forks": forks,
    }
    at4k = [r for r in rows if r["history"] == 4096]
    result["ttft_ratio_at_4k"] = at4k[0]["ttft_ratio_vs_turn1"] if at4k else None
    result["max_copies_per_child"] = max(f["copies_per_child"] for f in forks)
    if beams:
        result["beams"] = _beam_memory(config, loaded, fresh, beams, beam_prompts, beam_tokens, hf)
    return result


def _beam_memory(config, loaded, fresh, width: int, prompts: tuple[int, ...], new_tokens: int, hf) -> dict:
    """Each prompt on fresh engines over the loaded model (a pool of its own, so the peak is the search's)."""
    from dataclasses import replace

    from pagedchat.bench.beams import beam_memory_summary, beam_pool_blocks, follow_blocks
    from pagedchat.engine import Engine

    def engine(prompt_len: int, beams: int):
        blocks = beam_pool_blocks(prompt_len, new_tokens, config.block_size, beams)
        return Engine(replace(config, num_blocks=blocks), loaded=loaded, show_progress=False)

    runs = []
    for prompt_len in prompts:
        prompt = fresh(prompt_len)
        beam = follow_blocks(engine(prompt_len, width), prompt, width, new_tokens)
        single = follow_blocks(engine(prompt_len, 0), prompt, 0, new_tokens)
        run = beam_memory_summary(prompt_len, width, config.block_size, beam, single)
        if hf:
            run["hf_beam_kv_tokens"] = hf.beam_kv_tokens(prompt, width, new_tokens)
            run["hf_beam_kv_blocks"] = run["hf_beam_kv_tokens"] / config.block_size
        runs.append(run)
    return {"width": width, "new_tokens": new_tokens, "block_size": config.block_size, "runs": runs}


def compute_ratio(config, history: int, message: int) -> float:
    """FLOPs of prefilling `message` tokens after `history` cached tokens over FLOPs with no history.
    Weights cost the same per token; attention grows with the context each new token attends to. This is
    what a perfect implementation's turn-k / turn-1 TTFT would be if compute-bound."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = 2 * layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                            + 3 * hidden * config.intermediate_size)

    def prefill(h: int) -> float:
        # query i (0-based) of the message sees h + i + 1 keys: QK^T and PV, 2 FLOPs per multiply-add each
        keys = message * h + message * (message + 1) / 2
        return message * weights + 4 * layers * heads * head_dim * keys

    return prefill(history) / prefill(0)


def _finish(engine, rid: str):
    for _ in engine.steps([rid]):
        pass
    return engine.pop_output(rid)


def _pinned_history(engine, prompt: list[int], reply_tokens: int):
    """The earlier turns: a prompt answered with `reply_tokens` tokens, kept pinned as the branch head."""
    from pagedchat.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    out = _finish(engine, engine.add_request(prompt, params, keep=True))
    handle = out.outputs[0].handle
    if handle is None:
        raise UserError("the history was not pinned (KV pool too small?)")
    return handle


class _Stopwatch:
    """Wraps one bound method of an engine object (instance attribute, the class is untouched) and adds up
    the time spent in it: how long the fork's own work takes, apart from prefill and decode."""

    def __init__(self, owner, name: str, device: str):
        self.owner, self.name, self.device, self.total = owner, name, device, 0.0
        self.inner = getattr(owner, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.inner(*args, **kwargs)
        _sync(self.device)
        self.total += time.perf_counter() - start
        return result

    def __enter__(self):
        setattr(self.owner, self.name, self)
        return self

    def __exit__(self, *exc):
        delattr(self.owner, self.name)


def _fork_cost(engine, handle, fresh, message_tokens: int, variants: int, repeats: int, device: str, hf) -> dict:
    """One turn on the pinned history answered as N variants against the same turn with one variant: blocks
    copied, new blocks, the time of the fork itself (block-table forks + copy-on-write block copies), and the
    time of the whole first two steps (prefill the message, fork, one decode step of every variant)."""
    from pagedchat.engine import SamplingParams

    bs = engine.pool.block_size
    # Worst case for forking: the prompt ends mid-block, so that partial block is shared and each child's
    # first write copies it. (A block-aligned prompt forks with no copy at all.)
    length = message_tokens + (bs // 2 if (handle.num_tokens + message_tokens) % bs == 0 else 0)

    def run(n: int) -> dict:
        # Three tokens: after the second step every variant holds its own tail block, before any finishes.
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, n=n, ignore_eos=True)
        copies0, used0 = engine.pool.cow_copies, engine.pool.num_used
        peak, steps, elapsed = used0, 0, 0.0
        with _Stopwatch(engine.pool, "fork_table", device) as forks, \
                _Stopwatch(engine.runner, "copy_blocks", device) as copies:
            _sync(device)
            start = time.perf_counter()
            rid = engine.add_request(handle.token_ids + fresh(length), params, parent=handle)
            for _ in engine.steps([rid]):
                steps += 1
                if steps == 2:
                    _sync(device)
                    elapsed = time.perf_counter() - start
                peak = max(peak, engine.pool.num_used)
        engine.pop_output(rid)
        return {"copies": engine.pool.cow_copies - copies0, "blocks": peak - used0, "two_steps_s": elapsed,
                "fork_s": forks.total + copies.total}

    one = [run(1) for _ in range(repeats)]
    many = [run(variants) for _ in range(repeats)]
    copies, copies_one = max(r["copies"] for r in many), max(r["copies"] for r in one)
    # Continuing the pinned history copies its partial last block once, whatever n is (the turn's own
    # copy-on-write); what the variants add on top of that is the fork's cost.
    row = {"history": handle.num_tokens, "variants": variants, "message_tokens": length, "cow_copies": copies,
           "cow_copies_one": copies_one, "copies_per_child": (copies - copies_one) / (variants - 1),
           "extra_blocks_one": max(r["blocks"] for r in one), "extra_blocks_n": max(r["blocks"] for r in many),
           "fork_ms": 1000 * _median([r["fork_s"] for r in many]),
           "fork_ms_one": 1000 * _median([r["fork_s"] for r in one]),
           "two_steps_ms": 1000 * _median([r["two_steps_s"] for r in many]),
           "two_steps_ms_one": 1000 * _median([r["two_steps_s"] for r in one])}
    if hf:
        ids = handle.token_ids + fresh(length)
        row["hf_two_steps_ms"] = 1000 * hf.sampled_variants(ids, variants, 1)   # slow: one run is plenty
        row["hf_kv_tokens_n"] = variants * (len(ids) + 1)
    return row


class _HFPeer:
    """transformers without a cache across turns: every turn prefills the whole history again."""

    def __init__(self, model_path: Path, device: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from pagedchat.bench.common import quiet_transformers
        from pagedchat.bench.models import torch_dtype

        quiet_transformers()
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype, device)).to(device)
        self.model.eval()
        self.model.generation_config.eos_token_id = None
        self.pad = self.model.config.pad_token_id or 0
        self._run(torch.tensor([[FIRST_ID] * 8]), 1)   # warm-up

    def _run(self, ids, new_tokens: int, **kw) -> float:
        import torch

        ids = ids.to(self.device)
        _sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=self.pad, **kw)
        _sync(self.device)
        return time.perf_counter() - start

    def ttft(self, prompts: list[list[int]]) -> float:
        import torch

        return _median([self._run(torch.tensor([p]), 1, do_sample=False) for p in prompts])

    def beam_kv_tokens(self, prompt: list[int], width: int, new_tokens: int) -> int:
        """Token positions in transformers' KV cache at the end of its beam search: W rows of the history."""
        import torch

        with torch.inference_mode():
            ids = torch.tensor([prompt], device=self.device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, num_beams=width, do_sample=False,
                                      pad_token_id=self.pad, return_dict_in_generate=True)
        keys = out.past_key_values.layers[0].keys     # (beams, kv heads, positions, head dim)
        return keys.shape[0] * keys.shape[-2]

    def sampled_variants(self, prompt: list[int], n: int, repeats: int) -> float:
        import torch

        return _median([self._run(torch.tensor([prompt]), 2, do_sample=True, num_return_sequences=n)
                        for _ in range(repeats)])


def print_chat_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    hf = r["hf_turn1_ttft_s"] is not None
    rows = [["turn 1 (no history)", r["turn1_ttft_s"] * 1000, 1.0, 1.0, 0,
             r["hf_turn1_ttft_s"] * 1000 if hf else None, None]]
    for t in r["turns"]:
        rows.append([f"history {t['history']}", t["ttft_s"] * 1000, t["ttft_ratio_vs_turn1"], t["compute_ratio"],
                     t["prefix_hit_tokens"], t.get("hf_reprefill_ttft_s", 0) * 1000 if hf else None,
                     t.get("speedup_vs_hf")])
    print_table(f"Multi-turn TTFT: {r['model']} on {r['device']} — a {r['message_tokens']}-token message after "
                f"the history", ["turn", "pagedchat ms", "vs turn 1", "FLOPs vs turn 1", "KV reused (tokens)",
                                 "transformers re-prefill ms", "speedup"], rows)
    frows = [[f["history"], f["cow_copies"] - f["cow_copies_one"], f["copies_per_child"], f["fork_ms"],
              f["extra_blocks_n"], f["extra_blocks_one"], f["two_steps_ms"], f["two_steps_ms_one"],
              f.get("hf_two_steps_ms"), f.get("hf_kv_tokens_n")] for f in r["forks"]]
    print_table(f"Forking the conversation into {r['variants']} variants",
                ["history", "blocks copied by the fork", "per child", "fork ms (tables + copies)",
                 f"new blocks n={r['variants']}", "new blocks n=1", f"prefill+fork+decode ms n={r['variants']}",
                 "same, n=1", f"transformers ms n={r['variants']}", "transformers KV tokens"], frows,
                caption=r["machine"])


def plot_chat(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    hist = [t["history"] for t in r["turns"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(hist, [t["ttft_s"] * 1000 for t in r["turns"]], "o-", color="tab:blue",
              label="pagedchat (pinned history, new message only)")
    if r["hf_turn1_ttft_s"] is not None:
        left.plot(hist, [t["hf_reprefill_ttft_s"] * 1000 for t in r["turns"]], "s-", color="tab:red",
                  label="transformers (re-prefill the history)")
    left.axhline(r["turn1_ttft_s"] * 1000, color="tab:blue", ls=":", lw=1, label="pagedchat turn 1")
    left.set_xscale("log", base=2)
    left.set_xticks(hist, [str(h) for h in hist])
    left.minorticks_off()
    left.set_yscale("log")
    left.set_xlabel("history (tokens)")
    left.set_ylabel("time to first token (ms)")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    copied = [f["cow_copies"] - f["cow_copies_one"] for f in r["forks"]]
    right.bar([str(h) for h in hist], copied, color="tab:blue")
    right.set_xlabel("history (tokens)")
    right.set_ylabel(f"blocks copied to fork {r['variants']} variants")
    right.set_ylim(0, max(r["variants"], max(copied) + 1))
    right.axhline(r["variants"] - 1, color="grey", ls="--", lw=0.8, label="1 per child")
    right.legend(fontsize=7)
    fig.suptitle(f"{r['model']} on {r['device']}: multi-turn TTFT and fork cost", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
