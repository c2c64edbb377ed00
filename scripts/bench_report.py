"""Write docs/benchmarks.md from the JSON results of scripts/run_benchmarks.sh.

    python scripts/bench_report.py docs/bench-results > docs/benchmarks.md

Every figure in the page comes from a result file, which carries the exact command, date and machine that
produced it; the prose around the figures is fixed text. A goal's status is computed, never written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def load_results(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


# -- formatting ----------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_block(*results: dict) -> str:
    return "```\n" + "\n".join(r["command"] for r in results) + "\n```"


def provenance(r: dict) -> str:
    return f"{r['date']}, {r['machine']}"


# -- goals ---------------------------------------------------------------------------------------------------
@dataclass
class Goal:
    claim: str
    target: str
    measured: str
    met: bool
    shortfall: str          # how far off, when missed
    source: str             # result file


def _at_least(value: float, goal: float) -> tuple[bool, str]:
    return value >= goal, f"{value / goal:.0%} of the goal ({goal - value:.3g} short)"


def _at_most(value: float, goal: float) -> tuple[bool, str]:
    return value <= goal, f"{value / goal:.2f} times the goal"


def goals(res: dict[str, dict]) -> list[Goal]:
    out = []
    m = res.get("memory")
    if m:
        ok, short = _at_least(m["kv_utilization"], 0.98)
        out.append(Goal("KV utilization at block 16 (tokens held / capacity of allocated blocks, time-averaged)",
                        ">= 98%", pct(m["kv_utilization"]), ok, short, "memory"))
        ok, short = _at_least(m["concurrency_ratio"], 4)
        out.append(Goal(f"Peak concurrent requests vs contiguous max-len reservation (max-len {m['trace']['max_len']},"
                        f" mean {m['trace']['mean_prompt']:g} + {m['trace']['mean_output']:g} tokens)", ">= 4x",
                        f"{times(m['concurrency_ratio'])} ({m['peak_concurrency_paged']} vs "
                        f"{m['peak_concurrency_contiguous']})", ok, short, "memory"))
        v = m["variants"]
        ok, short = _at_most(v["ratio"], 1.15)
        out.append(Goal(f"{v['n']} variants of a {v['history']}-token history ({v['tail']} new tokens each) vs one",
                        "<= 1.15x blocks", f"{times(v['ratio'])} (history ending mid-block: "
                        f"{times(v['ratio_mid_block'])}; distinct-token floor {times(v['ideal_ratio'])})", ok, short,
                        "memory"))
        per_child = max(f["copies_per_child"] for f in m.get("fork_cost", [{"copies_per_child": 0}]))
        chat = res.get("chat-cpu-small") or res.get("chat-cpu-tiny")
        if chat:
            per_child = max(per_child, chat["max_copies_per_child"])
        hist = sorted({f["history"] for f in m.get("fork_cost", [])})
        out.append(Goal("Blocks copied per child when forking, as the history grows "
                        f"({hist[0] if hist else '?'}..{hist[-1] if hist else '?'} tokens)", "<= 1, flat",
                        f"max {per_child:g} per child at every length", per_child <= 1,
                        f"{per_child:g} copies per child", "memory, chat-cpu-small"))
    c = res.get("chat-cpu-small")
    if c and c.get("ttft_ratio_at_4k") is not None:
        row = next(t for t in c["turns"] if t["history"] == 4096)
        ok, short = _at_most(c["ttft_ratio_at_4k"], 1.3)
        out.append(Goal(f"Turn-k TTFT at a 4k history vs turn 1 ({c['model']}, {c['message_tokens']}-token message)",
                        "<= 1.3x", f"{times(c['ttft_ratio_at_4k'])} (compute ratio {times(row['compute_ratio'])}; "
                        f"{times(row.get('speedup_vs_hf'))} faster than re-prefill)", ok, short, "chat-cpu-small"))
    t = res.get("throughput-cpu-small")
    if t:
        for peer, goal, label in (("hf-generate", 1.5, "transformers padded `generate`"),
                                  ("hf-cb", 4.0, "transformers continuous batching")):
            if peer in t["speedup"]:
                ok, short = _at_least(t["speedup"][peer], goal)
                out.append(Goal(f"CPU throughput vs {label}, {t['requests']} mixed prompts ({t['model']})",
                                f">= {goal:g}x", times(t["speedup"][peer]), ok, short, "throughput-cpu-small"))
    return out


def goals_table(gs: list[Goal]) -> str:
    return table(["claim", "goal", "measured", "status"],
                 [[g.claim, g.target, g.measured, "met" if g.met else f"**missed** ({g.shortfall})"] for g in gs])


# -- sections ------------------------------------------------------------------------------------------------
def memory_section(res: dict[str, dict]) -> str:
    m, s = res.get("memory"), res.get("memory-shared")
    if not m:
        return ""
    t = m["trace"]
    parts = ["## Memory: the block pool against contiguous reservation", "",
             "The real `BlockPool`, `Scheduler` and `Engine.step()` run on a synthetic trace with the model runner "
             "swapped for bookkeeping (no model). The peer reserves max-len slots per admitted request, "
             "first come first served, with the same per-step token budget. " + provenance(m) + ".", "",
             command_block(*(r for r in (m, s) if r)), "",
             f"Trace: {t['requests']} requests queued at once, lognormal lengths (sigma {t['sigma']:g}) with mean "
             f"prompt {t['mean_prompt']:g} and mean output {t['mean_output']:g} tokens clipped to max-len "
             f"{t['max_len']} (realized means {t['mean_prompt_tokens']:.0f} + {t['mean_output_tokens']:.0f}), "
             f"pool {t['pool_tokens']} tokens = {m['pool_blocks']} blocks of {t['block_size']} or "
             f"{m['contiguous_slots']} max-len slots.", ""]
    rows = [["KV utilization (time-averaged)", pct(m["kv_utilization"]), pct(m["contiguous_utilization"])],
            ["peak concurrent requests", m["peak_concurrency_paged"], m["peak_concurrency_contiguous"]],
            ["mean concurrent requests", num(m["mean_concurrency_paged"]), num(m["mean_concurrency_contiguous"])],
            ["engine steps to finish the trace", m["steps_paged"], m["steps_contiguous"]],
            ["preemptions", m["preemptions"], 0]]
    parts += [table(["", "paged", "contiguous"], rows), "",
              f"`concurrency_ratio` {times(m['concurrency_ratio'])}. The mean concurrency ratio is lower "
              f"({times(m['mean_concurrency_paged'] / m['mean_concurrency_contiguous'])}) because the paged run "
              f"empties its queue in {m['steps_paged']} steps and then drains the last long requests alone, while "
              f"the contiguous run stays slot-bound for {m['steps_contiguous']} steps.", ""]
    v = m["variants"]
    parts += [f"**Variants.** {v['n']} variants of one {v['history']}-token history, {v['tail']} tokens each: "
              f"{v['blocks_n']} blocks against {v['blocks_one']} for one ({times(v['ratio'])}); the distinct tokens "
              f"alone need {times(v['ideal_ratio'])}, so the only overhead is block rounding. With a history ending "
              f"mid-block its partial block is copied once per child: {times(v['ratio_mid_block'])}. Contiguous "
              f"reservation (and `generate(num_return_sequences=N)`) holds {times(v['contiguous_ratio'])}.", ""]
    if m.get("fork_cost"):
        fc = m["fork_cost"]
        parts += ["**Fork cost** (blocks copied when the N - 1 children first write):", "",
                  table(["history (tokens)"] + [str(f["history"]) for f in fc],
                        [["copies per child"] + [num(f["copies_per_child"]) for f in fc]]), ""]
    if m.get("block_size_sweep"):
        parts += ["**Block size**: tail waste against block-table length (same trace and pool).", "",
                  table(["block size", "KV utilization", "tail waste", "table entries for max-len",
                         "peak concurrency"],
                        [[x["block_size"], pct(x["kv_utilization"]), pct(x["tail_waste"]), x["max_table_entries"],
                          x["peak_concurrency"]] for x in m["block_size_sweep"]]), ""]
    if s:
        parts += [f"**Shared system prompt** ({s['trace']['shared_prefix']} tokens in front of every prompt): "
                  f"sharing its blocks saves {pct(s['shared_prefix_saving'])} of the blocks the same running "
                  f"requests would hold with private copies; KV utilization {pct(s['kv_utilization'])}, peak "
                  f"concurrency {s['peak_concurrency_paged']} vs {s['peak_concurrency_contiguous']} "
                  f"({times(s['concurrency_ratio'])}). The picture above is this run: the light green band is "
                  "what the same requests would need without sharing.", ""]
    return "\n".join(parts)


def throughput_section(res: dict[str, dict], key: str, title: str, picture: str | None) -> str:
    t = res.get(key)
    if not t:
        return ""
    labels = {"pagedchat": "pagedchat engine", "hf-generate": "transformers `generate`, padded batch",
              "hf-cb": "transformers continuous batching (`generate_batch` engine)"}
    rows = []
    for name, m in t["systems"].items():
        agree = t["greedy_agreement"].get(name)
        rows.append([labels[name], num(m["output_tok_per_s"]), num(m["ttft_p50_s"] * 1000),
                     num(m["ttft_p99_s"] * 1000), num(m["peak_memory_mib"]),
                     "1.00x" if name == "pagedchat" else times(t["speedup"][name]),
                     "-" if agree is None else f"{agree['identical']}/{agree['of']}"])
    lengths = t["prompt_tokens"]
    parts = [f"### {title}", "", command_block(t), "",
             f"{provenance(t)}. {t['requests']} prompts of {min(lengths)}..{max(lengths)} tokens (mean "
             f"{sum(lengths) / len(lengths):.0f}), {t['max_tokens']} new tokens each, greedy, EOS ignored; KV sized "
             f"for everything at once ({t['kv_blocks']} blocks of {t['block_size']}) for both paged systems; "
             f"{t['threads'] or 'default'} torch thread(s) per system; median of {t['repeats']} alternating runs. "
             "Peak memory is what each process adds above its loaded weights (resident set on CPU).", "",
             table(["system", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "peak memory MiB",
                    "pagedchat speedup", "greedy tokens = pagedchat"], rows), ""]
    if t.get("pagedchat_profile"):
        shares = t["pagedchat_profile"]["shares"]
        parts += ["Where pagedchat's step time goes (cProfile of the same batch):", "",
                  table(["part", "share"], [[k, pct(v)] for k, v in shares.items()]), ""]
    if picture:
        parts += [f"![throughput]({picture})", ""]
    return "\n".join(parts)


def chat_section(res: dict[str, dict], key: str, title: str, picture: str | None) -> str:
    c = res.get(key)
    if not c:
        return ""
    hf = c["hf_turn1_ttft_s"] is not None
    rows = [["turn 1 (no history)", num(c["turn1_ttft_s"] * 1000), "1.00x", "1.00x", 0,
             num(c["hf_turn1_ttft_s"] * 1000) if hf else "-", "-"]]
    for t in c["turns"]:
        rows.append([f"{t['history']} tokens", num(t["ttft_s"] * 1000), times(t["ttft_ratio_vs_turn1"]),
                     times(t["compute_ratio"]), t["prefix_hit_tokens"],
                     num(t["hf_reprefill_ttft_s"] * 1000) if hf else "-", times(t.get("speedup_vs_hf"))])
    frows = [[f["history"], f["cow_copies"] - f["cow_copies_one"], num(f["copies_per_child"]), num(f["fork_ms"]),
              f"{f['extra_blocks_n']} / {f['extra_blocks_one']}", num(f["two_steps_ms"]), num(f["two_steps_ms_one"]),
              num(f.get("hf_two_steps_ms")), num(f.get("hf_kv_tokens_n"))] for f in c["forks"]]
    parts = [f"### {title}", "", command_block(c), "",
             f"{provenance(c)}. Each turn sends a new {c['message_tokens']}-token message after a pinned history "
             f"(median of {c['repeats']}; every repetition a different message, so only the history can be "
             "reused; \"vs turn 1\" divides by turn-1 TTFTs measured alternately with those turns, so load drift on "
             "the shared machine cancels). \"compute ratio\" is the FLOP ratio of that prefill to turn 1 for this model: what a "
             "compute-bound implementation would show.", "",
             table(["history", "pagedchat TTFT ms", "vs turn 1", "compute ratio", "KV reused (tokens)",
                    "transformers re-prefill ms", "pagedchat speedup"], rows), "",
             f"Forking the conversation into {c['variants']} variants (the prompt ends mid-block: the worst case). "
             "\"fork ms\" is the time inside the fork itself (block-table forks and copy-on-write block copies); "
             "the prefill+fork+decode columns time the first two engine steps of the turn. transformers "
             "`generate(num_return_sequences=N)` copies the whole history N times instead.", "",
             table(["history", "blocks copied", "per child", "fork ms", f"new blocks n={c['variants']} / n=1",
                    f"prefill+fork+decode ms n={c['variants']}", "same n=1",
                    f"transformers ms n={c['variants']}", "transformers KV tokens"], frows), ""]
    if picture:
        parts += [f"![multi-turn TTFT and fork cost]({picture})", ""]
    return "\n".join(parts)


def kernels_section(res: dict[str, dict]) -> str:
    """The kernels engineer's measurements, as they come (one row per measurement)."""
    k = res.get("kernels-gpu")
    if not k or not k.get("measurements"):
        return ""
    rows = k["measurements"]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return "\n".join(["## Kernels (GPU)", "", command_block(k), "", provenance(k) + ".", "",
                      table(keys, [[num(row.get(key)) if isinstance(row.get(key), (int, float)) else
                                    row.get(key, "-") for key in keys] for row in rows]), "",
                      "![kernels](img/kernels-gpu.png)", ""])


def misses_section(res: dict[str, dict], gs: list[Goal]) -> str:
    missed = [g for g in gs if not g.met]
    parts = ["## Goals missed: by how much, why, and what would close them", ""]
    if not missed:
        return "\n".join(parts + ["Every goal measured here is met.", ""])
    for g in missed:
        parts.append(f"- **{g.claim}**: goal {g.target}, measured {g.measured} — {g.shortfall}. "
                     + _why(g, res))
    return "\n".join(parts + [""])


def _why(g: Goal, res: dict[str, dict]) -> str:
    if g.source == "chat-cpu-small":
        c = res["chat-cpu-small"]
        row = next(t for t in c["turns"] if t["history"] == 4096)
        return (f"Why: only the {c['message_tokens']} new tokens are prefilled ({row['prefix_hit_tokens']} history "
                "tokens are reused, see the table), but each new token still attends to the whole 4k history. In "
                f"this small model attention is a large share of the work: by FLOPs alone turn k costs "
                f"{times(row['compute_ratio'])} turn 1, so no implementation could reach 1.3x on it; and the CPU "
                "path (the torch twin of the paged kernels) gathers the whole context into a contiguous copy per "
                "layer before attending. What closes it: models where the weights dominate (the 1B shape has a "
                f"compute ratio of {times(_compute_ratio_1b(c['message_tokens']))} at 4k), the Triton prefill kernel "
                "reading blocks in place on a GPU, and a CPU path that attends block by block instead of "
                "gathering.")
    if g.source == "throughput-cpu-small":
        t = res["throughput-cpu-small"]
        shares = (t.get("pagedchat_profile") or {}).get("shares", {})
        attention = shares.get("attention (paged kernels, torch path)", 0.0)
        overhead = shares.get("everything else (scheduler, batch preparation, Python)", 0.0)
        lengths = t["prompt_tokens"]
        padded, real = len(lengths) * max(lengths), sum(lengths)
        cost = (f"pagedchat's CPU attention path is the torch twin of the paged kernels, {pct(attention)} of its step "
                "time in the profile: per step and layer it gathers every sequence's context into a padded "
                "contiguous tensor, transposes, masks and copies it again before two matmuls, where transformers "
                f"attends with fused SDPA; scheduling and batch preparation take another {pct(overhead)}. ")
        if "generate" in g.claim:
            return ("Why: the waste paged batching removes is padding — the static batch prefills "
                    f"{padded:,} token slots for {real:,} prompt tokens ({padded / real:.1f}x) and attends over the "
                    "padding at every decode step — and pagedchat does avoid it (see its TTFT and memory), but "
                    + cost + "What would close it: a CPU attention path that runs `scaled_dot_product_attention` "
                    "on the gathered context (or attends block by block without the extra copies), and on a GPU the "
                    "Triton kernels with CUDA graphs (GPU numbers pending).")
        return ("Why: transformers' continuous batching is itself a paged, unpadded engine with the same block "
                "size, pool and token budget; on a CPU both run the same matmuls over the same tokens, so a 4x lead "
                "would need it to waste three quarters of its time, and it does not. What separates them here is "
                "per-step cost: " + cost + "What would narrow the gap: the faster CPU attention path above (attention "
                "is the largest share of pagedchat's step); a multiple like 4x can only come where per-step overhead and kernels "
                "dominate, i.e. on a GPU with pagedchat's Triton kernels and CUDA graphs (pending).")
    return ""


def _compute_ratio_1b(message: int) -> float:
    from pagedchat.bench.chat import compute_ratio
    from pagedchat.bench.models import random_config

    return compute_ratio(random_config("llama", "1b"), 4096, message)


def headline(res: dict[str, dict], gs: list[Goal]) -> str:
    return table(["claim", "goal", "measured (CPU, 2026-11-21)", ""],
                 [[g.claim.split(" (")[0], g.target, g.measured.split(" (")[0], "met" if g.met else "missed"]
                  for g in gs])


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(res: dict[str, dict]) -> str:
    gs = goals(res)
    any_result = next(iter(res.values()), {})
    gpu = any(k.endswith("gpu-1b") or k == "kernels-gpu" for k in res)
    parts = ["# Benchmarks", "",
             "Every claim measured against the alternative in the same run, on the same machine. Regenerate "
             "everything with `scripts/run_benchmarks.sh` (each result in `docs/bench-results/*.json` records its "
             "command, date and machine; this page is written from them by `python scripts/bench_report.py`).",
             "", f"Results from {any_result.get('date', '?')} on: {any_result.get('machine', '?')} "
             f"(code at commit {git_commit()} when the page was written). The machine was shared with other "
             "jobs while these ran: absolute times are noisy (a few ms at the small end), which is why every "
             "comparison is a ratio measured in the same run, with runs alternating between the systems.", ""]
    if not gpu:
        parts += ["**GPU numbers are pending**: no GPU was lent for these runs. `scripts/run_benchmarks.sh` runs the "
                  "GPU variants (a 1B-shaped random model in bf16, 256 requests; multi-turn on the same model; "
                  "`pagedchat bench kernels`) whenever CUDA is present.", ""]
    parts += ["## Goals", "", goals_table(gs), "",
              "## Headline (for the README)", "", headline(res, gs), "",
              "![KV memory over time, paged vs contiguous](img/memory.png)", "",
              memory_section(res),
              "## Throughput: pagedchat against transformers", "",
              "Three systems generate the same tokens for the same prompts, each in its own process: the pagedchat "
              "engine; transformers `model.generate` on one left-padded batch with an attention mask; "
              "transformers' own continuous batching (`ContinuousBatchingManager`, what `generate_batch` runs) "
              "with the same KV block size, number of blocks and per-step token budget as pagedchat.", "",
              throughput_section(res, "throughput-cpu-small", "CPU, small random Llama (8 layers, hidden 512)",
                                 "img/throughput.png"),
              throughput_section(res, "throughput-cpu-tiny", "CPU, tiny random Llama (2 layers, hidden 64): "
                                 "overhead-bound", None),
              throughput_section(res, "throughput-gpu-1b", "GPU, 1B-shaped random Llama, bf16",
                                 "img/throughput-gpu.png"),
              "## Multi-turn chat: TTFT as the history grows, and forking", "",
              chat_section(res, "chat-cpu-small", "CPU, small random Llama", "img/chat.png"),
              chat_section(res, "chat-cpu-tiny", "CPU, tiny random Llama", None),
              chat_section(res, "chat-gpu-1b", "GPU, 1B-shaped random Llama, bf16", "img/chat-gpu.png"),
              kernels_section(res),
              misses_section(res, gs)]
    return "\n".join(p for p in parts if p is not None).rstrip() + "\n"


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench-results")
    res = load_results(folder)
    if not res:
        sys.exit(f"no results in {folder}: run scripts/run_benchmarks.sh")
    sys.stdout.write(render(res))


if __name__ == "__main__":
    main()
