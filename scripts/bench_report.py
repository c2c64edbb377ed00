"""Fill the result tables of docs/benchmarks.md from the JSON results in docs/bench-results.

    python scripts/bench_report.py            # rewrite every marked block of the page from its result file
    python scripts/bench_report.py --check    # exit 1 when a block differs from what its file gives (a test runs it)

The prose of the page is written by hand; its tables are not. A block is

    <!-- bench: RENDERER FILE.json -->
    ...written by this script...
    <!-- /bench -->

and holds the machine, date and command of FILE (every result records them) and the table RENDERER makes of
it. A FILE that does not exist yet (a machine class not measured so far) gives a marked placeholder that says
how to produce it: `scripts/run_benchmarks.sh` writes every file this page names.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "bench-results"
BLOCK = re.compile(r"(<!-- bench: (\S+) (\S+) -->\n)(.*?)(<!-- /bench -->)", re.S)


# -- formatting ----------------------------------------------------------------------------------------------
def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def times(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def ms(seconds) -> str:
    return "-" if seconds is None else num(1000 * seconds)


def secs(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def provenance(r: dict) -> str:
    return f"*{r.get('machine', 'machine not recorded')}; {r.get('date', 'date not recorded')}:*\n```\n{r['command']}\n```"


# -- renderers: one per kind of table, each given one result file ---------------------------------------------------
def memory(r: dict) -> str:
    t = r["trace"]
    rows = [["KV utilization (time-averaged)", pct(r["kv_utilization"]), pct(r["contiguous_utilization"])],
            ["peak concurrent requests", r["peak_concurrency_paged"], r["peak_concurrency_contiguous"]],
            ["mean concurrent requests", num(r["mean_concurrency_paged"]), num(r["mean_concurrency_contiguous"])],
            ["engine steps to finish the trace", r["steps_paged"], r["steps_contiguous"]],
            ["preemptions", r["preemptions"], 0]]
    v = r["variants"]
    return "\n\n".join([
        f"{t['requests']} requests queued at once, lognormal lengths (mean prompt {t['mean_prompt']:g}, mean "
        f"output {t['mean_output']:g} tokens, at most {t['max_len']}), one pool of {t['pool_tokens']:,} tokens: "
        f"{r['pool_blocks']} blocks of {t['block_size']}, or {r['contiguous_slots']} max-length slots.",
        table(["", "paged (pagedchat)", "contiguous reservation"], rows),
        f"**{times(r['concurrency_ratio'])}** the peak concurrent requests. {v['n']} variants of one "
        f"{v['history']}-token history ({v['tail']} new tokens each) hold {times(v['ratio'])} the blocks of one "
        f"({times(v['ratio_mid_block'])} when the history ends mid-block; contiguous: {times(v['contiguous_ratio'])}). "
        "Blocks copied per child at a fork, as the history grows: "
        + ", ".join(f"{f['history']}: {num(f['copies_per_child'])}" for f in r.get("fork_cost", [])) + "."])


def block_size(r: dict) -> str:
    return table(["block size", "KV utilization", "tail waste", "table entries at max length", "peak concurrency"],
                 [[x["block_size"], pct(x["kv_utilization"]), pct(x["tail_waste"]), x["max_table_entries"],
                   x["peak_concurrency"]] for x in r["block_size_sweep"]])


def shared_prefix(r: dict) -> str:
    return (f"A {r['trace']['shared_prefix']}-token system prompt in front of every prompt: its blocks are held once, "
            f"which saves {pct(r['shared_prefix_saving'])} of the blocks private copies would take; peak concurrency "
            f"{r['peak_concurrency_paged']} against {r['peak_concurrency_contiguous']} "
            f"({times(r['concurrency_ratio'])}).")


def window(r: dict) -> str:
    w = r["sliding_window"]
    return (f"{w['layers']} layers, window {w['window']}, budget {w['budget_layer_blocks']:,} {w['unit']}.\n\n"
            + table(["context", "blocks a chat holds", "without releasing", "share", "chats that fit",
                     "without releasing", "more chats"],
                    [[f"{x['context']:,}", f"{x['blocks_held_release']:,}", f"{x['blocks_held_no_release']:,}",
                      pct(x["blocks_held_ratio"]), x["concurrent_chats_release"], x["concurrent_chats_no_release"],
                      times(x["concurrency_ratio"])] for x in w["rows"]]))


def beams(r: dict) -> str:
    b = r["beams"]
    return (f"Width {b['width']}, {b['new_tokens']} new tokens, blocks of {b['block_size']} tokens.\n\n"
            + table(["prompt tokens", f"beam {b['width']}: peak blocks", "one sequence", f"{b['width']} contiguous "
                     "copies", "peak vs one sequence", "most block copies in a step"],
                    [[x["prompt_tokens"], x["peak_blocks"], x["one_sequence_peak_blocks"],
                      x["contiguous_peak_blocks"], times(x["peak_ratio_vs_one"]), x["max_copies_per_step"]]
                     for x in b["runs"]]))


def batch1(r: dict) -> str:
    b = r["batch1"]
    systems = b["systems"]
    rows = [[name, num(s.get("decode_tok_per_s")), ms(s.get("prefill_s")), num(s.get("decode16_tok_per_s"))]
            for name, s in systems.items()]
    parts = [f"{b['threads']} thread per system, median of {b['repeats']} alternating runs; decode: "
             f"{b['new_tokens']} tokens after a {b['decode_prompt']}-token prompt; prefill: "
             f"{b['prefill_tokens']} tokens; 16 prompts: decode only, once every prompt has its first token.",
             table(["system", "batch-1 decode tok/s", f"{b['prefill_tokens']}-token prefill ms",
                    "16 prompts decoding tok/s"], rows)]
    pairs = [("pagedchat", "transformers"), ("pagedchat", "llama.cpp F32"), ("pagedchat int8", "llama.cpp Q8_0")]
    ratios = [f"{a} against {b} {times(systems[a]['decode_tok_per_s'] / systems[b]['decode_tok_per_s'])}"
              for a, b in pairs if systems.get(a, {}).get("decode_tok_per_s") and systems.get(b, {}).get(
                  "decode_tok_per_s")]
    if ratios:
        parts.append("Batch-1 decode: " + "; ".join(ratios) + ".")
    start = b.get("startup")
    if start:
        parts.append(f"Start-up: `pagedchat run` to its first byte of output {times(start['ratio'])} the time of "
                     f"`python -c \"import torch\"` ({start['median_s']['pagedchat run']:.2f} s against "
                     f"{start['median_s']['import torch']:.2f} s).")
    return "\n\n".join(parts)


def throughput(r: dict) -> str:
    labels = {"pagedchat": "pagedchat", "hf-generate": "transformers `generate`, padded batch",
              "hf-cb": "transformers continuous batching"}
    rows = []
    for name, m in r["systems"].items():
        agree = r.get("greedy_agreement", {}).get(name)
        rows.append([labels.get(name, name), num(m["output_tok_per_s"]), ms(m["ttft_p50_s"]),
                     num(m["peak_memory_mib"]), "1.00x" if name == "pagedchat" else times(r["speedup"].get(name)),
                     "-" if agree is None else f"{agree['identical']}/{agree['of']}"])
    lengths = r["prompt_tokens"]
    return (f"{r['requests']} prompts of {min(lengths)}-{max(lengths)} tokens, {r['max_tokens']} new tokens each, "
            f"greedy; {r['threads'] or 'default'} thread per system; median of {r['repeats']} alternating runs; "
            f"end to end (prefill included).\n\n"
            + table(["system", "output tok/s", "TTFT p50 ms", "peak memory MiB", "pagedchat is",
                     "same greedy tokens"], rows))


def chat_turns(r: dict) -> str:
    rows = [["1 (no history)", ms(r["turn1_ttft_s"]), "1.00x", "1.00x", 0, ms(r.get("hf_turn1_ttft_s")), "-"]]
    rows += [[f"{t['history']:,} tokens of history", ms(t["ttft_s"]), times(t["ttft_ratio_vs_turn1"]),
              times(t["compute_ratio"]), f"{t['prefix_hit_tokens']:,}", ms(t.get("hf_reprefill_ttft_s")),
              times(t.get("speedup_vs_hf"))] for t in r["turns"]]
    return (f"{r['model']}; each turn sends a new {r['message_tokens']}-token message; median of {r['repeats']}.\n\n"
            + table(["turn", "TTFT ms", "vs turn 1", "FLOPs vs turn 1", "KV reused (tokens)",
                     "transformers re-prefill ms", "pagedchat is"], rows))


def chat_forks(r: dict) -> str:
    return table(["history", "blocks copied per child", "fork ms", f"new blocks n={r['variants']} / n=1",
                  f"first two steps ms n={r['variants']}", "n=1", f"transformers ms n={r['variants']}"],
                 [[f"{f['history']:,}", num(f["copies_per_child"]), num(f["fork_ms"]),
                   f"{f['extra_blocks_n']} / {f['extra_blocks_one']}", num(f["two_steps_ms"]),
                   num(f["two_steps_ms_one"]), num(f.get("hf_two_steps_ms"))] for f in r["forks"]])


def serve(r: dict) -> str:
    paged, reserved = r["modes"]["paged"], r["modes"]["reserved"]
    unit = "turns/s" if r["workload"].get("kind") == "chat" else "req/s"
    # a search offers each mode its own rates: one row per rate either mode ran, "-" where the other did not
    by_rate = [{row["rate"]: row for row in m["rows"]} for m in (paged, reserved)]
    ttft = lambda x: "-" if x is None else f"**{secs(x['ttft_p99_s'])}**" if x["sustained"] else secs(x["ttft_p99_s"])  # noqa: E731
    rows = []
    for rate in sorted(by_rate[0].keys() | by_rate[1].keys()):
        p, q = by_rate[0].get(rate), by_rate[1].get(rate)
        rows.append([num(rate), ttft(p), ttft(q), num(p["output_tokens_per_s"]) if p else "-",
                     num(q["output_tokens_per_s"]) if q else "-", p["preemptions"] if p else "-",
                     pct(p.get("prefix_hit_rate")) if p else "-"])
    return (f"Paged sustains **{num(paged['sustained_rate'])} {unit}**, reservation {num(reserved['sustained_rate'])} "
            f"{unit}: **{times(r['sustained_ratio'])}** (p99 TTFT under {r['ttft_target_s']:g} s, no failed "
            f"request; bold: sustained).\n\n"
            + table([f"offered {unit}", "p99 TTFT s, paged", "p99 TTFT s, reserved", "out tok/s, paged",
                     "out tok/s, reserved", "preemptions, paged", "prefix hits, paged"], rows))


def spec(r: dict) -> str:
    return (f"{r['model']}, `--speculate {r['method']}`, {r['max_tokens']} new tokens per request, "
            f"{r['threads']} thread per engine, median of {r['repeats']}; decode tokens/s with and without, "
            "the two engines stepping in turn.\n\n"
            + table(["workload", "batch", "off tok/s", "ngram tok/s", "speed-up (wall)", "speed-up (CPU time)",
                     "drafts accepted", "same tokens"],
                    [[x["workload"], x["batch"], num(x["off_tok_s"]), num(x["spec_tok_s"]), times(x["speedup"]),
                      times(x.get("cpu_speedup")), pct(x["acceptance_rate"]) if x["proposed_tokens"] else "no drafts",
                      {True: "yes", False: "**no**"}.get(x.get("greedy_identical"), "sampled")] for x in r["rows"]]))


def accuracy(r: dict) -> str:
    if "modes" not in r:
        return accuracy_int8(r)
    text, rows = r["text"], []
    for mode, m in r["modes"].items():
        g, q = m["greedy"], m.get("questions")
        rows.append([mode, pct(g["tokens_agreeing"]), f"{g['prompts_identical']}/{g['prompts']}",
                     f"{m['divergences_at_near_ties']}/{g['prompts'] - g['prompts_identical']}",
                     f"{m['max_logit_error']:.4f} ({pct(m['max_logit_error_rel_spread'])})",
                     f"{m['perplexity']:.4f}" if "perplexity" in m else "-",
                     f"{m['perplexity_increase']:+.2%}" if "perplexity_increase" in m else "-",
                     f"{pct(q['accuracy'])} ({q['right']}/{r['questions']})" if q else "-",
                     f"{q['identical_to_fp']}/{r['questions']}" if q else "-"])
    scored = (f"; perplexity of {text['scored']:,} tokens ({text['kind']}, windows of {text['window']})"
              if text.get("kind") else "")
    parts = [f"{r['model']}: {r['greedy_prompts']} prompts x {r['greedy_tokens']} greedy tokens{scored}"
             + (f"; {r['questions']} held-out questions" if r.get("questions") else "") + ".",
             table(["mode", "greedy tokens agreeing", "prompts identical", "divergences at a near-tie",
                    "max logit error (/ spread)", "perplexity", "vs fp", "questions right", "answers = fp's"], rows)]
    peer = r.get("llama.cpp")
    if peer and "note" not in peer:
        parts.append("llama.cpp on the same token windows: " + ", ".join(
            f"{k} {v['perplexity']:.4f} ({v['perplexity_increase']:+.2%})" for k, v in peer.items()) + ".")
    return "\n\n".join(parts)


def accuracy_int8(r: dict) -> str:
    """The int8-only format of earlier result files."""
    return (f"`--quantize {r['quantize']}` against {r['baseline']}: {r['prompts']} prompts x {r['tokens']} greedy "
            f"tokens.\n\n"
            + table(["model", "greedy tokens agreeing", "prompts identical", "divergences at a near-tie",
                     "max logit error", "/ logit spread"],
                    [[x["model"], pct(x["greedy_agreement"]), f"{x['identical_prompts']}/{x['prompts']}",
                      f"{x['divergences_at_near_ties']}/{x['prompts'] - x['identical_prompts']}",
                      f"{x['max_logit_error']:.4f}", pct(x["max_logit_error_rel_spread"])] for x in r["rows"]]))


def cpu_sweep(r: dict) -> str:
    t, names = r["decode_tok_per_s"], list(r["decode_tok_per_s"])
    peers = [n for n in names if not n.startswith("pagedchat")]
    rows = []
    both = {"pagedchat native", "pagedchat torch"} <= set(t)  # neither path skipped
    for b in map(str, r["batches"]):
        ours = t["pagedchat"][b]
        paths = [times(t["pagedchat native"][b] / t["pagedchat torch"][b])] if both else []
        rows.append([b, *(num(t[n][b]) for n in names), *paths, *(times(ours / t[n][b]) for n in peers)])
    quantize = f", `--quantize {r['quantize']}`" if r.get("quantize") else ""
    new = r["new_tokens"]
    counts = sorted(set(new.values())) if isinstance(new, dict) else [new]
    decoded = f"{counts[0]}" if len(counts) == 1 else f"{counts[-1]} (batch 1) to {counts[0]}"
    return (f"Decode tokens/s (decode only: {decoded} new tokens per sequence after prompts of "
            f"{r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} tokens){quantize}; {r['threads']} thread per system, "
            f"median of {r['repeats']} "
            "alternating runs. `pagedchat` is what a user gets: per step size, whichever of the native step and "
            "the torch path measured faster on this machine.\n\n"
            + table(["batch", *names, *(["native / torch"] if both else []), *(f"pagedchat / {n}" for n in peers)],
                    rows))


def kv_dtype(r: dict) -> str:
    rows = [[x["model"], x["kv_dtype"], f"{x['bytes_per_token']:,}", f"{x['pool_tokens']:,}" if "pool_tokens" in x
             else "-", x.get("chats_4k", "-"), times(x["vs_auto"])] for x in r["pool"]]
    held = "; ".join(f"{x['kv_dtype']}: {x['resident']} of {x['offered']} offered" for x in r["demo_chats_held"])
    chat = r["demo_chats_held"][0]
    parts = [table(["model", "KV dtype", "bytes per token", "tokens in 256 MiB", "4k-token chats", "vs the model's dtype"],
                   rows),
             f"The demo model's full-context chats ({chat['chat_tokens']} tokens) held pinned at once in {chat['budget']}: "
             f"{held}."]
    return "\n\n".join(parts)


def launches(r: dict) -> str:
    rows = [[name, x["per_layer"], x["model_outside_layers"], x["step_outside_model"], x["per_step_like"]]
            for name, x in (("unfused ops", r["unfused"]), ("fused layer kernels", r["fused"]))]
    return (f"{r['model']}, {r['dtype']}, batch {r['batch']}, context {r['context']}: launches of one decode step on "
            f"the CUDA code path (its ops counted on CPU, Triton kernels interpreted).\n\n"
            + table(["path", "per layer", "model, outside layers", "step, outside the model",
                     f"a {r['layers_like']}-layer step"], rows)
            + f"\n\n{times(r['per_layer_ratio'])} fewer launches per layer fused.")


def host_step_ab(r: dict) -> str:
    return (f"Host CPU time of one engine step without a model (vocabulary {r['vocab']}, {r['max_tokens']} new "
            f"tokens, median of {r['repeats']}), {r.get('parts', 'the sampler')} before ({r['before']}) and after "
            f"({r['after']}).\n\n"
            + table(["batch", "workload", "before ms", "after ms", "after / before"],
                    [[x["batch"], x["workload"], num(x["before_ms"]), num(x["after_ms"]),
                      times(x["after_over_before"])] for x in r["rows"]]))


def host_step(r: dict) -> str:
    return (f"Host CPU time of one engine step without a model (vocabulary {r['vocab']}, {r['new_tokens']} new "
            f"tokens, {r['threads']} thread, median of the decode steps, then of the repeats), with the steps not "
            f"overlapped and overlapped.\n\n"
            + table(["batch", "workload", "steps", "ms per step", "us per sequence"],
                    [[x["batch"], x["workload"], x.get("steps", "not overlapped"), num(x["step_ms"]),
                      num(x["per_sequence_us"])] for x in r["rows"]]))


def resources(r: dict) -> str:
    return (f"Compiled for {r['target']} by Triton {r['triton']} on a CPU machine (`ptxas -v`).\n\n"
            + table(["kernel", "dtype", "configuration", "registers", "spill stores", "spill loads", "shared bytes"],
                    [[x["kernel"], x["dtype"], x["config"], x["registers"], x["spill_stores"], x["spill_loads"],
                      x["shared_bytes"]] for x in r["rows"]]))


def _parallel_cells(own: dict, plain: dict, peer: dict) -> list[str]:
    """The 16-sequence decode cells (results from before that row was measured leave them empty)."""
    if "decode_16_tok_s" not in own:
        return ["", "", ""]
    ratio = own["decode_16_tok_s"] / peer["decode_16_tok_s"]
    return [f"{own['decode_16_tok_s']:.1f} ({ratio:.2f}x)", f"{plain['decode_16_tok_s']:.1f}",
            f"{peer['decode_16_tok_s']:.1f}"]


def real_models(r: dict) -> str:
    """Real GGUF files against llama.cpp on the same file (scripts/bench_real_models.py)."""
    models = list(r["models"].items())
    header = [""]
    for name, _ in models:
        header += [f"{name}: pagedchat (file formats)", "dequantized", "llama.cpp"]
    rows = {"batch-1 decode, tok/s": [], "16 sequences decoding together, tok/s": [],
            "prefill of 512 tokens, s": [], "engine load, s": [],
            "`run -m FILE \"hi\"`, process start to exit after one token, s": [], "peak resident memory of that run": []}
    for _, m in models:
        own, plain, peer = (m["systems"][k] for k in ("pagedchat (file formats)", "pagedchat (--quantize none)",
                                                       "llama.cpp"))
        ratio = own["decode_tok_s"] / peer["decode_tok_s"]
        faster = peer["prefill_512_s"] / own["prefill_512_s"]
        rows["batch-1 decode, tok/s"] += [f"{own['decode_tok_s']:.1f} ({ratio:.2f}x)", f"{plain['decode_tok_s']:.1f}",
                                          f"{peer['decode_tok_s']:.1f}"]
        rows["16 sequences decoding together, tok/s"] += _parallel_cells(own, plain, peer)
        rows["prefill of 512 tokens, s"] += [f"{secs(own['prefill_512_s'])} ({faster:.2f}x as fast)",
                                             secs(plain["prefill_512_s"]), secs(peer["prefill_512_s"])]
        rows["engine load, s"] += [secs(own["load_s"]), secs(plain["load_s"]), secs(peer["load_s"])]
        first, rss = m["run_to_first_token_s"], m["peak_rss_bytes"]
        rows[list(rows)[4]] += [f"{secs(first['pagedchat'])} ({first['pagedchat'] / first['llama.cpp']:.2f}x the time)",
                                "", secs(first["llama.cpp"])]
        rows[list(rows)[5]] += [f"{rss['pagedchat'] / 2**20:,.0f} MiB", "", f"{rss['llama.cpp'] / 2**20:,.0f} MiB"]
    pairs = len(next(iter(r["models"].values())).get("run_to_first_token_runs", {}).get("pagedchat", [])) or r["repeats"]
    return (f"{r['threads']} thread(s) for every system, medians of {r['repeats']} alternating runs ({pairs} for "
            f"the one-shot `run`).{_builds(r.get('builds'))}\n\n"
            + table(header, [[k, *v] for k, v in rows.items() if any(v)]) + _shapes(r.get("shapes", {})))


def _builds(builds: dict | None) -> str:
    """What each side's compiled code targets, where the run recorded it (a build for another ISA than the CPU's
    best is how one CPU measures the AVX2 paths)."""
    if not builds:
        return ""
    cpu = (builds.get("llama_cpp") or "not installed").split("CPU : ")[-1].strip(" |")
    enabled = " ".join(f.split(" = ")[0] for f in cpu.split(" | ") if f.endswith("= 1")) or cpu
    return (f" pagedchat's native step built with `{builds['pagedchat_flags']}` ({builds['pagedchat']}); "
            f"llama.cpp's CPU backend with {enabled}.")


def _shapes(shapes: dict) -> str:
    """Batch-1 decode of the files the benchmark writes (random blocks in a real model's shape and types)."""
    lines = []
    for name, m in shapes.items():
        own, peer = m["systems"]["pagedchat (file formats)"], m["systems"]["llama.cpp"]
        lines.append(f"- `{name}` (random blocks, written by the benchmark): batch-1 decode pagedchat "
                     f"{own['decode_tok_s']:.1f} tok/s, llama.cpp {peer['decode_tok_s']:.1f} tok/s "
                     f"({own['decode_tok_s'] / peer['decode_tok_s']:.2f}x)")
    return "\n\n" + "\n".join(lines) if lines else ""


def web(r: dict) -> str:
    """The chat page in a real browser (scripts/bench_web.py)."""
    t = r["token_to_screen_ms"]
    return (f"{r['browser']}, headless; medians of {r['repeats']} page loads.\n\n"
            + table(["figure", "measured", "target"],
                    [["first contentful paint of the page", f"{num(r['first_paint_ms'])} ms", "< 300 ms"],
                     [f"a streamed piece of a reply on screen after the server has it (median / p95 / max of "
                      f"{t['pieces']})", f"{t['median']:.1f} / {t['p95']:.1f} / {t['max']:.1f} ms", "< 50 ms"],
                     ["a saved session of 500 messages opens (click to the frame that shows it)",
                      f"{num(r['open_500_messages_ms'])} ms", "< 500 ms"]]))


def figures(r: dict) -> str:
    """Any result as its numbers (the GPU check's file: one JSON of every figure)."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix] = value

    walk("", {k: v for k, v in r.items() if k not in ("command", "date", "machine")})
    return table(["figure", "value"], [[k, num(v)] for k, v in flat.items()])


def gpu_check(r: dict) -> str:
    """The GPU check's one line per step (status, seconds, headline figures), as the check itself prints it."""
    from pagedchat.bench.gpu import summary_rows

    rows = [[name, status, "-" if seconds is None else f"{seconds:.0f}", words.replace("|", "/")]
            for name, status, seconds, words in summary_rows(r)]
    return (f"git {r['git_revision']}, budget {r['budget_s']:.0f} s\n\n"
            + table(["step", "status", "seconds", "figures"], rows))


RENDERERS = {"gpu-check": gpu_check, "memory": memory, "block-size": block_size, "shared-prefix": shared_prefix, "window": window,
             "beams": beams, "batch1": batch1, "throughput": throughput, "chat-turns": chat_turns,
             "chat-forks": chat_forks, "serve": serve, "spec": spec, "accuracy": accuracy, "cpu-sweep": cpu_sweep,
             "kv-dtype": kv_dtype, "launches": launches, "host-step-ab": host_step_ab, "host-step": host_step, "resources": resources, "real-models": real_models,
             "web": web, "figures": figures}


# -- the page ------------------------------------------------------------------------------------------------------
def render_block(renderer: str, name: str, results: Path) -> str:
    if renderer not in RENDERERS:
        raise SystemExit(f"docs/benchmarks.md names an unknown table {renderer!r}; known: {', '.join(RENDERERS)}")
    path = results / name
    if not path.is_file():
        return (f"> **Pending:** not measured on this machine class yet. `scripts/run_benchmarks.sh` writes "
                f"`docs/bench-results/{name}`, then `python scripts/bench_report.py` fills this place.\n")
    result = json.loads(path.read_text())
    return f"{provenance(result)}\n\n{RENDERERS[renderer](result)}\n"


def render_page(text: str, results: Path = RESULTS) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group(2), m.group(3), results) + m.group(5), text)


def cited(text: str) -> set[str]:
    """The result files the page names (in blocks and in its prose)."""
    return set(re.findall(r"bench-results/([\w.-]+\.json)", text)) | {m.group(3) for m in BLOCK.finditer(text)}


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    page = render_page(text)
    if "--check" in argv:
        if page != text:
            print("docs/benchmarks.md differs from its results: run python scripts/bench_report.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(BLOCK.findall(page))} tables)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
