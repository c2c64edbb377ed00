"""`pagedchat bench ...`: measure the memory and speed claims against the alternative, in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import typer

from pagedchat.errors import UserError

bench = typer.Typer(help="Benchmarks: pagedchat against the alternative, measured in the same run.",
                    no_args_is_help=True)


@bench.callback()
def native_ready() -> None:
    """Benchmarks time the engine as it runs once the native CPU decode step is built: on a machine that has
    no build yet, a first engine would take the torch path while the build runs in the background, so the
    build is made here, before anything is timed (pagedchat/native/build.py)."""
    from pagedchat.native import build

    build.load(wait=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench, name="bench")


JSON = typer.Option(False, "--json", help="Print one JSON object (for scripts) instead of tables.")
PLOT = typer.Option(None, "--plot", help="Write a PNG picture of the run to FILE.png.")


@bench.command("memory", help="The real block pool and scheduler on a synthetic trace vs contiguous max-len "
                              "reservation (no model needed).")
def memory(
    requests: int = typer.Option(1000, "--requests", help="Requests in the trace (all queued at once)."),
    max_len: int = typer.Option(2048, "--max-len", help="Longest request (prompt + output); what contiguous "
                                                        "reservation sets aside per request."),
    mean_prompt: float = typer.Option(300, "--mean-prompt", help="Mean prompt tokens (lognormal; the shared "
                                                                 "prefix comes on top)."),
    mean_output: float = typer.Option(200, "--mean-output", help="Mean output tokens (lognormal)."),
    sigma: float = typer.Option(1.0, "--sigma", help="Lognormal shape of both lengths (0 = all equal)."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block (power of two)."),
    pool_tokens: int = typer.Option(65536, "--pool-tokens", help="KV pool size in tokens, for both sides."),
    shared_prefix: int = typer.Option(0, "--shared-prefix", help="Tokens of a system prompt common to all."),
    variants: int = typer.Option(8, "--variants", help="N for the variants measurement (N forks of one "
                                                       "max-len-ish history)."),
    variant_tail: int = typer.Option(32, "--variant-tail", help="Tokens each variant decodes after the fork."),
    max_batched_tokens: int = typer.Option(2048, "--max-batched-tokens", help="Per-step token budget."),
    max_seqs: int = typer.Option(0, "--max-seqs", help="Cap on running requests (0 = memory is the limit)."),
    seed: int = typer.Option(0, "--seed", help="Trace seed: same seed, same numbers."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Block-size sweep 8..128 (tail waste vs "
                                                                "table size)."),
    beams: int = typer.Option(0, "--beams", help="Also measure beam search with W beams over 1k/2k-token "
                                                 "prompts vs one sequence and a contiguous per-beam cache."),
    window: bool = typer.Option(True, "--window/--no-window", help="Sliding-window rows: a Gemma-3-shaped "
                                "model (5 window : 1 global, window 1024) releasing blocks vs holding them, "
                                "at 8k and 32k contexts."),
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    from pagedchat.bench.memory import TraceParams, print_memory_report, run_memory_bench
    from pagedchat.bench.window import print_window_report, run_window_bench

    if beams < 0:
        raise UserError(f"--beams must be >= 1, got {beams}")

    params = TraceParams(requests=requests, max_len=max_len, mean_prompt=mean_prompt, mean_output=mean_output,
                         sigma=sigma, block_size=block_size, pool_tokens=pool_tokens, shared_prefix=shared_prefix,
                         variants=variants, variant_tail=variant_tail, max_batched_tokens=max_batched_tokens,
                         max_seqs=max_seqs, seed=seed)
    result = run_memory_bench(params, sweep=sweep, plot=_plot_path(plot))
    if beams:
        from pagedchat.bench.beams import print_beam_report, run_beam_memory_bench

        result["beams"] = run_beam_memory_bench(beams, block_size=block_size)
        if plot:
            _plot_beams(result["beams"], _plot_path(plot))
    if window:
        result["sliding_window"] = run_window_bench()

    def report(result: dict) -> None:
        print_memory_report(result)
        if window:
            print_window_report(result["sliding_window"])
        if beams:
            print_beam_report(result["beams"])

    _finish(result, as_json, report)


MODEL = typer.Option(None, "-m", "--model", help="models.toml name or local HF folder.")
RANDOM = typer.Option(None, "--random", help="Build a random model on the fly instead: llama, mistral, qwen2 "
                                             "or qwen3.")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda or auto.")
DTYPE = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.")
THREADS = typer.Option(None, "--threads", help="torch CPU threads per system (default 1 on CPU: a shared "
                                               "machine oversubscribed by several runs times noise; 0 = torch's "
                                               "default).")
SEED = typer.Option(0, "--seed", help="Prompt seed.")
AUTO_SIZE = typer.Option("auto", "--random-size", help="tiny, small, 1b, or auto (small on CPU, 1b on CUDA).")


def _sized_model(model: Optional[str], random_arch: Optional[str], random_size: str, device: str, workdir: str,
                 max_positions: int):
    """(folder, name) of -m MODEL or of a random --random ARCH model (auto size: 1b in bf16 on CUDA, else small)."""
    from pagedchat.bench.models import resolve_model

    size = random_size if random_size != "auto" else ("1b" if device.startswith("cuda") else "small")
    return resolve_model(model, random_arch, size, Path(workdir), max(4096, max_positions),
                         dtype="bfloat16" if size == "1b" else "float32")


@bench.command("throughput", help="pagedchat vs transformers generate (padded batch) and transformers' "
                                  "continuous batching: same model, prompts and machine, one run.")
def throughput(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = AUTO_SIZE,
    requests: int = typer.Option(16, "--requests", help="Prompts (mixed lengths), all submitted at once."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="New tokens per prompt (EOS ignored)."),
    mean_prompt: float = typer.Option(128, "--mean-prompt", help="Mean prompt tokens (lognormal)."),
    max_prompt: int = typer.Option(512, "--max-prompt", help="Longest prompt."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size, for both paged systems."),
    max_batched_tokens: int = typer.Option(2048, "--max-batched-tokens", help="Per-step token budget, for "
                                                                              "both continuous batchers."),
    systems: str = typer.Option("pagedchat,hf-generate,hf-cb", "--systems",
                                help="Comma-separated, from pagedchat, pagedchat-sync (steps not overlapped: "
                                     "its GPU default is to overlap them), hf-generate, hf-cb."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per system, taking turns; the median counts."),
    profile: bool = typer.Option(False, "--profile", help="Also profile pagedchat's steps (where time goes)."),
    timeout: float = typer.Option(1800, "--timeout", help="Seconds each system's run may take; a peer that takes "
                                                          "longer becomes a row with that error."),
    batch1: bool = typer.Option(True, "--batch1/--no-batch1", help="Also time batch-1 decode, 512-token prefill "
                                                                   "and `run` start-up (CPU)."),
    peer: Optional[str] = typer.Option(None, "--peer", help="llama.cpp: add it to the batch-1 rows (F32, F16, "
                                                           "Q8_0 via llama-cpp-python; skipped if not installed)."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    import tempfile

    from pagedchat.bench.models import resolve_device
    from pagedchat.bench.throughput import plot_throughput, print_throughput_report, run_throughput_bench

    device = resolve_device(device)
    plot = _plot_path(plot)
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = _sized_model(model, random_arch, random_size, device, tmp, max_prompt + max_tokens + 64)
        result = run_throughput_bench(path, name, requests=requests, max_tokens=max_tokens, mean_prompt=mean_prompt,
                                      max_prompt=max_prompt, block_size=block_size,
                                      max_batched_tokens=max_batched_tokens, device=device, dtype=dtype,
                                      systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
                                      repeats=repeats, seed=seed, threads=_threads(threads, device),
                                      timeout=timeout, profile=profile)
        if batch1 and device == "cpu":
            result["batch1"] = _batch1_rows(path, threads, repeats, peer, seed)

    def report(result: dict) -> None:
        print_throughput_report(result)
        if "batch1" in result:
            from pagedchat.bench.batch1 import print_batch1_report

            print_batch1_report(result["batch1"])

    _finish(result, as_json, report, plot, plot_throughput)


@bench.command("batch1", help="One person at a terminal: batch-1 decode and time to first token against transformers "
                              "(on CUDA also with graphs off, and against the memory-bandwidth floor).")
def batch1_command(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = AUTO_SIZE,
    new_tokens: int = typer.Option(0, "--new-tokens", help="Decode tokens (0: 64 on CPU, 256 on CUDA)."),
    ttft_tokens: int = typer.Option(2048, "--ttft-tokens", help="CUDA: prompt tokens of the time-to-first-token "
                                                               "runs."),
    repeats: int = typer.Option(3, "--repeats", help="CPU: runs per system, taking turns; the median counts."),
    peer: Optional[str] = typer.Option(None, "--peer", help="CPU: llama.cpp adds its rows (F32, F16, Q8_0)."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
) -> None:
    import tempfile

    from pagedchat.bench.batch1 import print_batch1_gpu_report, print_batch1_report, run_batch1_gpu
    from pagedchat.bench.models import resolve_device

    device = resolve_device(device)
    on_gpu = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = _sized_model(model, random_arch, random_size, device, tmp, ttft_tokens + 64)
        if on_gpu:
            result = run_batch1_gpu(path, device, dtype, new_tokens=new_tokens or 256, ttft_tokens=ttft_tokens,
                                    seed=seed)
        else:
            from pagedchat.bench.batch1 import run_batch1_bench

            result = run_batch1_bench(path, _threads(threads, "cpu") or 1, repeats=repeats, new_tokens=new_tokens or 64,
                                      peer=peer, seed=seed)
    result["model"] = name
    _finish(result, as_json, print_batch1_gpu_report if on_gpu else print_batch1_report)


@bench.command("cpu-sweep", help="CPU decode speed at batch sizes 1 to 64: the native step, the torch path, what "
                                  "pagedchat picks between them, transformers and llama.cpp, one run.")
def cpu_sweep(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = typer.Option("small", "--random-size", help="tiny, small or 1b."),
    batches: str = typer.Option("1,2,4,8,16,32,64", "--batches", help="Comma-separated batch sizes."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="int8 or int4 for pagedchat (llama.cpp: Q8_0 or "
                                                                   "Q4_0 of the same weights)."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per system, taking turns; the median counts."),
    peer: Optional[str] = typer.Option(None, "--peer", help="llama.cpp adds its row (needs llama-cpp-python, gguf)."),
    skip: str = typer.Option("", "--skip", help="Rows to leave out, comma-separated: native, torch, transformers "
                                               "(the torch path and transformers are slow on a 1B model)."),
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
) -> None:
    import tempfile

    from pagedchat.bench.cpu_sweep import SKIPPABLE, print_cpu_sweep_report, run_cpu_sweep
    from pagedchat.bench.models import resolve_model

    if quantize not in (None, "int8", "int4"):
        raise UserError(f"--quantize must be int8 or int4, got {quantize!r}")
    if peer not in (None, "llama.cpp"):
        raise UserError(f"--peer must be llama.cpp, got {peer!r}")
    if repeats < 1:
        raise UserError("--repeats must be >= 1")
    sizes = list(_lengths(batches, "--batches"))
    skipped = tuple(name for name in skip.split(",") if name)
    if unknown := [name for name in skipped if name not in SKIPPABLE]:
        raise UserError(f"--skip takes {', '.join(SKIPPABLE)}; got {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = resolve_model(model, random_arch, random_size, Path(tmp), 1024)
        result = run_cpu_sweep(path, _threads(threads, "cpu") or 1, sizes, repeats=repeats, quantize=quantize,
                               peer=peer, seed=seed, skip=skipped)
    result["model"] = name
    _finish(result, as_json, print_cpu_sweep_report)


@bench.command("chat", help="Multi-turn TTFT as the history grows (pinned history vs transformers re-prefill) "
                            "and the cost of forking a conversation into N variants.")
def chat(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = typer.Option("tiny", "--random-size", help="tiny, small or 1b."),
    history: str = typer.Option("1024,2048,4096,8192", "--history", help="History lengths in tokens."),
    message_tokens: int = typer.Option(64, "--message-tokens", help="Tokens of each new message."),
    reply_tokens: int = typer.Option(16, "--reply-tokens", help="Tokens of the last reply in the history."),
    variants: int = typer.Option(8, "--variants", help="N for the fork measurement."),
    repeats: int = typer.Option(5, "--repeats", help="Measurements per point (median; a new message each)."),
    block_size: int = typer.Option(16, "--block-size"),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also time transformers."),
    reopen: bool = typer.Option(False, "--reopen", help="Instead: reopen a saved session in a fresh engine, "
                                                        "first-turn TTFT with the disk KV tier vs re-prefill."),
    processes: bool = typer.Option(False, "--processes", help="With --reopen: real `pagedchat run --session` "
                                                              "processes (a random model gets the demo tokenizer)."),
    serve_restart: bool = typer.Option(False, "--serve-restart", help="Instead: restart `pagedchat serve` under "
                                       "a shared system prompt of --history tokens; the first request's TTFT and "
                                       "cached_tokens after it, disk tier vs --kv-disk 0."),
    beams: int = typer.Option(0, "--beams", help="Also measure the blocks beam search with W beams holds on "
                                                 "this model vs one sequence and a contiguous per-beam cache."),
    beam_prompts: str = typer.Option("1024,2048", "--beam-prompts", help="Prompt lengths for --beams."),
    beam_tokens: int = typer.Option(64, "--beam-tokens", help="New tokens per beam search for --beams."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    import tempfile

    from pagedchat.bench.chat import plot_chat, print_chat_report, run_chat_bench
    from pagedchat.bench.reopen import (print_reopen_report, print_restart_report, run_reopen_bench,
                                        run_reopen_process_bench, run_serve_restart_bench)
    from pagedchat.bench.models import resolve_device, resolve_model

    histories = _lengths(history, "--history")
    prompts = _lengths(beam_prompts, "--beam-prompts")
    if beams < 0 or beam_tokens < 2:
        raise UserError("--beams must be >= 1 and --beam-tokens >= 2")
    device = resolve_device(device)
    plot = _plot_path(plot)
    needed = max(max(histories) + message_tokens + reply_tokens, max(prompts) + beam_tokens if beams else 0) + 64
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        max_positions = max(4096, -(-needed // 1024) * 1024)
        if serve_restart:
            result = run_serve_restart_bench(*_chat_model(model, random_arch, random_size, Path(tmp), max_positions),
                                             histories, repeats=repeats, seed=seed, threads=_threads(threads, device))
            _finish(result, as_json, print_restart_report)
            return
        if reopen and processes:
            result = run_reopen_process_bench(*_chat_model(model, random_arch, random_size, Path(tmp), max_positions),
                                              histories, message_tokens, reply_tokens, repeats, seed,
                                              _threads(threads, device))
            _finish(result, as_json, print_reopen_report)
            return
        path, name = resolve_model(model, random_arch, random_size, Path(tmp), max_positions,
                                   dtype="bfloat16" if random_size == "1b" else "float32")
        if reopen:
            result = run_reopen_bench(path, name, histories, message_tokens, reply_tokens, repeats, block_size,
                                      device, dtype, seed, _threads(threads, device))
            _finish(result, as_json, print_reopen_report)
            return
        result = run_chat_bench(path, name, histories=histories, message_tokens=message_tokens,
                                reply_tokens=reply_tokens, variants=variants, repeats=repeats,
                                block_size=block_size, device=device, dtype=dtype, seed=seed,
                                threads=_threads(threads, device), baseline=baseline, beams=beams,
                                beam_prompts=prompts, beam_tokens=beam_tokens)

    def draw(result: dict, plot: str) -> None:
        plot_chat(result, plot)
        if beams:
            _plot_beams(result["beams"], plot)

    def report(result: dict) -> None:
        print_chat_report(result)
        if beams:
            from pagedchat.bench.beams import print_beam_report

            print_beam_report(result["beams"])

    _finish(result, as_json, report, plot, draw)


def _lengths(text: str, flag: str) -> tuple[int, ...]:
    try:
        lengths = tuple(sorted({int(h) for h in text.split(",") if h.strip()}))
    except ValueError:
        raise UserError(f"{flag} wants comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise UserError(f"{flag} needs at least one positive length")
    return lengths


def _plot_beams(beams: dict, plot: str) -> None:
    """The beam picture beside the main one: NAME-beams.png."""
    from pagedchat.bench.beams import plot_beam_memory

    beams["plot"] = str(Path(plot).with_name(Path(plot).stem + "-beams.png"))
    plot_beam_memory(beams, beams["plot"])


@bench.command("serve", help="Latency under load through `pagedchat serve`: Poisson arrivals, paged vs up-front "
                             "reservation (what a contiguous cache must do) on the same engine and pool; the highest "
                             "load each sustains with p99 TTFT under a target, searched for (or over --rates).")
def serve(
    model: Optional[str] = typer.Option(None, "-m", "--model", help="models.toml name or local HF folder with a "
                                                                   "tokenizer (default: a random bench model "
                                                                   "with the demo model's tokenizer)."),
    random_arch: str = typer.Option("llama", "--random", help="Architecture of the random bench model."),
    random_size: str = typer.Option("tiny", "--random-size", help="tiny, small or 1b."),
    url: Optional[str] = typer.Option(None, "--url", help="Measure a running server on 127.0.0.1 instead (one "
                                                          "mode: name it with --modes)."),
    workload: str = typer.Option("lognormal", "--workload", help="lognormal (independent requests) or chat "
                                                                 "(multi-turn conversations)."),
    rates: Optional[str] = typer.Option(None, "--rates", help="A fixed sweep of offered loads, requests/s, "
                                                                "comma-separated (default: each mode's limit is "
                                                                "searched for, from 1 request/s up)."),
    max_rate: float = typer.Option(512, "--max-rate", help="The highest load the search offers, requests/s."),
    requests: int = typer.Option(60, "--requests", help="Requests per rate and mode (count bound)."),
    max_seconds: float = typer.Option(60, "--max-seconds", help="Arrivals per rate stop after this (time bound)."),
    mean_prompt: float = typer.Option(64, "--mean-prompt", help="Mean prompt tokens (chat: per user message)."),
    mean_output: float = typer.Option(48, "--mean-output", help="Mean reply tokens (lognormal)."),
    sigma: float = typer.Option(0.8, "--sigma", help="Lognormal shape of both lengths."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="max_tokens every request declares: what up-front "
                                                              "reservation holds."),
    system_tokens: int = typer.Option(0, "--system-tokens", help="Shared system prompt tokens (0 = none)."),
    turns: int = typer.Option(4, "--turns", help="Chat: turns per conversation."),
    think: float = typer.Option(0.5, "--think", help="Chat: mean seconds between a reply and the next turn."),
    pool_blocks: int = typer.Option(192, "--pool-blocks", help="KV pool of each server, in blocks."),
    block_size: int = typer.Option(16, "--block-size"),
    ttft_target: float = typer.Option(2.0, "--ttft-target", help="p99 TTFT (s) a sustained rate stays under."),
    timeout: float = typer.Option(60, "--timeout", help="Seconds before a request counts as failed."),
    modes: str = typer.Option("paged,reserved", "--modes", help="Which of paged,reserved to run."),
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    import tempfile
    from pathlib import Path

    from pagedchat.bench.load import Workload
    from pagedchat.bench.models import resolve_device
    from pagedchat.bench.serve import SweepParams, check_loopback, plot_serve, print_serve_report, run_serve_bench

    url = check_loopback(url) if url else None
    if workload not in ("lognormal", "chat"):
        raise UserError(f"--workload wants lognormal or chat, got {workload!r}")
    try:
        rate_list = tuple(sorted({float(r) for r in rates.split(",") if r.strip()})) if rates is not None else ()
    except ValueError:
        raise UserError(f"--rates wants comma-separated requests/s, got {rates!r}") from None
    if rates is not None and not rate_list:
        raise UserError("--rates wants comma-separated requests/s, e.g. 1,2,4 (leave it out to search)")
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    if url and len(mode_list) != 1:
        raise UserError("--url measures one server: name its mode with --modes paged or --modes reserved")
    if min(requests, turns, max_tokens) < 1 or min(mean_prompt, mean_output) <= 0 or sigma < 0 or think < 0:
        raise UserError("--requests, --turns, --max-tokens, --mean-prompt and --mean-output must be positive")
    device = resolve_device(device)
    plot = _plot_path(plot)
    load = Workload(kind=workload, requests=requests, mean_prompt=mean_prompt, mean_output=mean_output, sigma=sigma,
                    max_tokens=max_tokens, system_tokens=system_tokens, turns=turns, think_s=think, seed=seed)
    sweep = SweepParams(rates=rate_list, search_to=max_rate, modes=mode_list, pool_blocks=pool_blocks,
                        block_size=block_size,
                        ttft_target_s=ttft_target, max_seconds=max_seconds, timeout_s=timeout,
                        threads=_threads(threads, device) or 0, device=device)
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = _chat_model(model, random_arch, random_size, Path(tmp))
        result = run_serve_bench(path, name, load, sweep, url=url, show_progress=not as_json)
    _finish(result, as_json, print_serve_report, plot, lambda result, plot: plot_serve([result], plot))


@bench.command("spec", help="Speculative decoding: decode tokens/s with and without it on the same prompts, one "
                            "run: edit-like, regenerate and plain workloads at batch 1 and a larger batch.")
def spec(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = typer.Option("small", "--random-size", help="tiny, small or 1b."),
    method: str = typer.Option("ngram", "--speculate", help="ngram or draft (with --draft-model)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model for --speculate draft."),
    batch: int = typer.Option(16, "--batch", help="The larger batch (batch 1 always runs)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="New tokens per request (EOS ignored)."),
    num_draft_tokens: int = typer.Option(6, "--num-draft-tokens", help="Most drafts per sequence and step."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per side, taking turns; the median counts."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    import tempfile
    from pathlib import Path

    from pagedchat.bench.models import resolve_device, resolve_model
    from pagedchat.bench.spec import plot_spec, print_spec_report, run_spec_bench

    device = resolve_device(device)
    plot = _plot_path(plot)
    if method not in ("ngram", "draft"):
        raise UserError(f"--speculate must be ngram or draft here, got {method!r}")
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = resolve_model(model, random_arch, random_size, Path(tmp))
        draft = str(resolve_model(draft_model, None, random_size, Path(tmp))[0]) if draft_model else None
        result = run_spec_bench(path, name, method, batches=(1, batch) if batch > 1 else (1,),
                                max_tokens=max_tokens, num_draft_tokens=num_draft_tokens, repeats=repeats,
                                device=device, dtype=dtype, threads=_threads(threads, device), seed=seed,
                                draft_model=draft)
    _finish(result, as_json, print_spec_report, plot, plot_spec)


@bench.command("accuracy", help="What quantization costs: each mode (--quantize, --kv-dtype) against the "
                                "unquantized model in one run: greedy agreement, perplexity of a fixed text, the "
                                "demo model's held-out questions.")
def accuracy(
    model: Optional[str] = MODEL,
    random_arch: Optional[str] = RANDOM,
    random_size: str = typer.Option("small", "--random-size", help="tiny, small or 1b."),
    init_std: Optional[float] = typer.Option(None, "--init-std", help="With --random: the initializer_range "
                                                                      "(default: the size's; 0.02 is what trained "
                                                                      "checkpoints look like)."),
    modes: str = typer.Option("fp,int8,int4", "--modes", help="Comma-separated: fp, int8, int4 (weights), "
                                                               "kv-int8, kv-fp8 (the KV pool)."),
    tokens: int = typer.Option(256, "--tokens", help="Greedy tokens per prompt (EOS ignored)."),
    prompts: int = typer.Option(6, "--prompts", help="Prompts for greedy agreement."),
    per_family: int = typer.Option(30, "--per-family", help="Demo questions per family and question set."),
    peer: Optional[str] = typer.Option(None, "--peer", help="llama.cpp: its perplexity of the same text at F32, "
                                                           "Q8_0 and Q4_0 (via llama-cpp-python)."),
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    seed: int = SEED,
    as_json: bool = JSON,
) -> None:
    import tempfile

    from pagedchat.bench.accuracy import print_accuracy_report, run_accuracy_bench
    from pagedchat.bench.models import resolve_device, resolve_model

    if peer not in (None, "llama.cpp"):
        raise UserError(f"--peer must be llama.cpp, got {peer!r}")
    device = resolve_device(device)
    count = _threads(threads, device)
    if count:
        import torch

        torch.set_num_threads(count)
    if prompts < 1 or tokens < 1:
        raise UserError("--prompts and --tokens must be >= 1")
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        if random_arch and init_std is not None:
            from pagedchat.bench.models import build_random_model

            path = build_random_model(random_arch, Path(tmp) / random_arch, random_size, 1024,
                                      initializer_range=init_std)
            name = f"random {random_arch} ({random_size}), init std {init_std:g}"
        else:
            path, name = resolve_model(model, random_arch, random_size, Path(tmp), 1024)
        result = run_accuracy_bench(path, name, [m.strip() for m in modes.split(",") if m.strip()], device=device,
                                    tokens=tokens, prompts=prompts, per_family=per_family, peer=peer, seed=seed)
    result["threads"] = count
    _finish(result, as_json, print_accuracy_report)


@bench.command("launches", help="Kernel launches of one decode step on the CUDA code path, per layer: the "
                                "unfused layer ops against the fused kernels (on CPU: Triton interpreted).")
def launches(
    model: Optional[str] = MODEL,
    random_arch: str = typer.Option("llama", "--random", help="Without -m: a random model of this family with "
                                                              "Llama-3.2-1B's heads (llama, mistral, qwen2, qwen3)."),
    device: str = DEVICE,
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 (the CUDA default), float16 or float32."),
    batch: int = typer.Option(1, "--batch", help="Sequences in the step."),
    context: int = typer.Option(512, "--context", help="Tokens of context per sequence."),
    as_json: bool = JSON,
) -> None:
    import tempfile
    from pathlib import Path

    from pagedchat.bench.launches import counting_model, print_launch_report, run_launch_bench
    from pagedchat.bench.models import resolve_device, resolve_model
    from pagedchat.kernels import HAS_TRITON

    if not HAS_TRITON:
        raise UserError("bench launches counts the Triton path: install triton")
    device = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = resolve_model(model, None, "tiny", Path(tmp)) if model else counting_model(random_arch, Path(tmp))
        result = run_launch_bench(path, name, device, dtype, batch, context)
    _finish(result, as_json, print_launch_report)


@bench.command("host-step", help="The host's work in one engine step without a model (scheduler, inputs, "
                                 "sampling, outputs): what a GPU waits for between steps, at batch 1 and 256.")
def host_step(
    batches: str = typer.Option("1,256", "--batches", help="Comma-separated batch sizes."),
    new_tokens: int = typer.Option(64, "--max-tokens", help="New tokens per request."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per row; the median counts."),
    as_json: bool = JSON,
) -> None:
    from pagedchat.bench.host_step import print_host_step_report, run_host_step_bench

    _finish(run_host_step_bench(_lengths(batches, "--batches"), new_tokens=new_tokens, repeats=repeats), as_json, print_host_step_report)


@bench.command("fused", help="The fused layer kernels against the unfused ops, one run: batch-1 decode with "
                             "CUDA graphs on and off, TTFT at 2,048 tokens, 256 requests x 128 tokens (CUDA).")
def fused(
    model: Optional[str] = MODEL,
    random_arch: str = typer.Option("llama", "--random", help="Without -m: a random model of this family."),
    random_size: str = typer.Option("1b", "--random-size", help="tiny, small or 1b (Llama-3.2-1B's shape)."),
    requests: int = typer.Option(256, "--requests", help="Requests of the many-request run."),
    repeats: int = typer.Option(3, "--repeats", help="Batch-1 runs and TTFT prompts per configuration."),
    device: str = DEVICE,
    as_json: bool = JSON,
) -> None:
    import tempfile
    from pathlib import Path

    from pagedchat.bench.fused import print_fused_report, run_fused_bench
    from pagedchat.bench.models import resolve_device, resolve_model

    device = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = resolve_model(model, None if model else random_arch, random_size, Path(tmp), 4096,
                                   dtype="bfloat16" if random_size == "1b" else "float32")
        result = run_fused_bench(path, name, device, requests=requests, repeats=repeats)
    _finish(result, as_json, print_fused_report)


def _finish(result: dict, as_json: bool, report: Callable[[dict], None], plot: Optional[str] = None,
            draw: Optional[Callable[[dict, str], None]] = None) -> None:
    """How a bench command ends: its picture when --plot asks for one (the file's name goes into the result),
    the provenance stamp, then one JSON object or the report."""
    from pagedchat.bench.common import print_json

    if plot and draw:
        draw(result, plot)
        result["plot"] = plot
    _stamp(result)
    print_json(result) if as_json else report(result)


def _stamp(result: dict) -> None:
    """Provenance for every number: the exact command line, the date and the machine."""
    import datetime
    import shlex
    import sys

    from pagedchat.bench.common import machine_description, machine_info

    result["command"] = "pagedchat " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result["date"] = datetime.date.today().isoformat()
    info = result.setdefault("machine_info", machine_info())
    result.setdefault("machine", machine_description(info))


def _batch1_rows(path, threads: Optional[int], repeats: int, peer: Optional[str], seed: int) -> dict:
    from pagedchat.bench.batch1 import run_batch1_bench, startup_times

    if peer not in (None, "llama.cpp"):
        raise UserError(f"--peer must be llama.cpp, got {peer!r}")
    count = _threads(threads, "cpu") or 1
    rows = run_batch1_bench(path, count, repeats=repeats, peer=peer, quantize="int8", seed=seed)
    rows["startup"] = startup_times(count, max(3, repeats))
    return rows


def _chat_model(model: Optional[str], random_arch: Optional[str], size: str, workdir, max_positions: int = 4096):
    """(folder, name) of a model that takes chat messages as text: -m MODEL, or random weights of --random
    ARCH over the demo model's tokenizer and chat template (without either: the demo model)."""
    from pagedchat.bench.models import build_chat_bench_model, resolve_model

    if model or not random_arch:
        return resolve_model(model, None, size, workdir)
    path = build_chat_bench_model(random_arch, workdir / f"{random_arch}-{size}", size, max_positions)
    return path, f"random {random_arch} ({size}) with the demo tokenizer"


def _threads(threads: Optional[int], device: str) -> Optional[int]:
    if threads is None:
        return 1 if device == "cpu" else None
    if threads < 0:
        raise UserError("--threads must be >= 0")
    return threads or None


@bench.command("gpu", help="Everything GPU-side in one run, each step under its own time limit: the GPU tests, "
                           "batch 1, throughput, the kernels. Writes OUTDIR/gpu-check.json (scripts/gpu_check.sh).")
def gpu(
    outdir: Optional[str] = typer.Argument(None, help="Where gpu-check.json and the logs go (default: "
                                                      "gpu-check-DATE)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the plan, the JSON and the table on CPU."),
) -> None:
    from pagedchat.bench.gpu import main

    code = main([*([outdir] if outdir else []), *(["--dry-run"] if dry_run else [])])
    if code:
        raise typer.Exit(code)


@bench.command("kernels", help="The Triton paged-attention kernels against copy bandwidth and SDPA (CUDA).")
def kernels(
    sweeps: Optional[str] = typer.Option(None, "--sweeps", help="Comma-separated decode sweeps (batch, context, "
                                                               "block_size, gqa); default all."),
    which: Optional[str] = typer.Option(None, "--kernels", help="Comma-separated kernels (decode, prefill, "
                                                                "write_kv, copy_blocks); default all."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32."),
    iters: Optional[int] = typer.Option(None, "--iters", help="Timed iterations per point."),
    impls: Optional[str] = typer.Option(None, "--impls", help="Comma-separated Triton implementations measured "
                                                              "side by side (v1, v2); default both."),
    tune: bool = typer.Option(False, "--tune", help="First time v2's candidate configurations per shape class "
                                                    "and cache the fastest for this GPU."),
    flex: bool = typer.Option(True, "--flex/--no-flex", help="Also time compiled FlexAttention on the batch sweep "
                                                            "(its compile takes tens of seconds)."),
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    """Wires the kernels engineer's `run_kernel_bench` (pagedchat/bench/kernels.py) to the CLI; passes only
    the arguments its signature takes."""
    import inspect

    import torch

    from pagedchat.bench.common import print_json

    try:
        from pagedchat.bench.kernels import run_kernel_bench
    except ImportError as e:
        raise UserError(f"the kernel benchmark is not available in this build ({e})") from None
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    offered = {"show": not as_json, "plot_path": _plot_path(plot), "dtype": dtype, "iters": iters,
               "sweeps": split(sweeps) if sweeps else None, "kernels": split(which) if which else None,
               "impls": split(impls) if impls else None, "tune_first": tune or None, "flex": flex}
    accepted = inspect.signature(run_kernel_bench).parameters
    try:
        result = run_kernel_bench(**{k: v for k, v in offered.items() if k in accepted and v is not None})
    except UserError:
        raise
    except Exception as e:
        if torch.cuda.is_available():
            raise
        raise UserError(f"bench kernels needs a CUDA GPU: {e}") from None
    if as_json:
        data = result if isinstance(result, dict) else {"measurements": result}
        _stamp(data)
        print_json(data)


def _plot_path(plot: Optional[str]) -> Optional[str]:
    if plot is None:
        return None
    if not plot.lower().endswith(".png"):
        raise UserError(f"--plot wants a .png file name, got {plot!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'pagedchat[plot]'") from None
    return plot


@bench.command("gguf", help="The Triton GGUF matmuls of a Llama-3.2-1B-shaped Q4_K_M model at batch 1: each "
                             "layer's tiles against copy bandwidth and bf16, and one step's matmuls in a CUDA graph "
                             "(CUDA).")
def gguf(
    iters: int = typer.Option(20, "--iters", help="Timed launches per figure; the median counts."),
    candidates: bool = typer.Option(True, "--candidates/--no-candidates", help="Also time the candidate tiles "
                                                                               "around the current one."),
    as_json: bool = JSON,
) -> None:
    from pagedchat.bench.gguf_kernels import print_gguf_report, run_gguf_bench

    _finish(run_gguf_bench(iters=iters, candidates=candidates), as_json, print_gguf_report)


@bench.command("step", help="Where a batch-1 decode step's time goes: the engine's own Python against the "
                            "model's forward (CPU; wall and thread CPU time).")
def step(
    model: Optional[str] = typer.Option("demo", "-m", "--model", help="models.toml name or local HF folder."),
    random_arch: Optional[str] = RANDOM,
    random_size: str = typer.Option("small", "--random-size", help="tiny, small or 1b (with --random)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="int8: the weight-only int8 model."),
    tokens: int = typer.Option(200, "--tokens", help="Decode steps per repeat."),
    repeats: int = typer.Option(5, "--repeats", help="Repeats; the median counts."),
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
) -> None:
    import tempfile
    from pathlib import Path

    from pagedchat import threads as torch_threads
    from pagedchat.bench.models import resolve_model
    from pagedchat.bench.step import print_step_report, run_step_bench

    count = _threads(threads, "cpu") or 1
    torch_threads.apply_threads(count)
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
        path, name = resolve_model(None if random_arch else model, random_arch, random_size, Path(tmp))
        result = run_step_bench(str(path), name, count, tokens, repeats, quantize)
    _finish(result, as_json, print_step_report)
