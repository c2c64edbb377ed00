"""`pagedchat bench throughput`: the pagedchat engine against transformers on the same model, prompts and
machine, in one run.

Three systems generate the same number of new tokens (greedy, EOS ignored) for the same mixed-length prompts:
  - pagedchat      the engine: continuous batching over the paged pool
  - hf-generate    transformers `model.generate` on one padded static batch (left padding, attention mask)
  - hf-cb          transformers' own continuous batching (`ContinuousBatchingManager`, the engine behind
                   `generate_batch`) with the same KV sizing: same block size, same number of blocks, same
                   per-step token budget
Each system runs in its own subprocess, so its peak memory is its own (resident set on CPU, the CUDA
allocator's peak on a GPU), measured above the memory held once the weights are loaded. With --repeats the
systems take turns (A B C A B C ...) and the median run of each counts, so a noisy machine hits all alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedchat.bench.common import lognormal_lengths, percentile, quiet_transformers, ratio
from pagedchat.errors import UserError

SYSTEMS = ("pagedchat", "pagedchat-sync", "hf-generate", "hf-cb")
LABELS = {"pagedchat": "pagedchat engine", "pagedchat-sync": "pagedchat, steps not overlapped",
          "hf-generate": "transformers generate (padded batch)", "hf-cb": "transformers continuous batching"}
FIRST_ID = 3   # random prompt ids skip the special tokens a config may use (pad 0, bos 1, eos 2)


def make_prompts(count: int, mean: float, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Mixed-length prompts of random token ids: lognormal lengths (mean `mean`), clipped to [8, max_len]."""
    rng = random.Random(seed)
    lengths = lognormal_lengths(rng, count, mean, 0.8, min(8, max_len), max_len)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(n)] for n in lengths]


def kv_blocks_for(prompts: list[list[int]], max_tokens: int, block_size: int) -> int:
    """Enough blocks for every request at full length at once: neither engine ever has to wait for memory."""
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + len(prompts) + 8


# -- the workers (each in its own process) --------------------------------------------------------------------
def _load_hf(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedchat.bench.models import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch_dtype(spec["dtype"], spec["device"]))
    model = model.to(spec["device"]).eval()
    model.generation_config.eos_token_id = None   # EOS is ignored: every request makes max_tokens tokens
    return model


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def worker_pagedchat(spec: dict, memory, overlap: bool | None = None) -> dict:
    """overlap=False: every step waits for its tokens before the next is scheduled (the engine's default on a
    GPU overlaps them; on a CPU it does not, so there the two rows run the same engine)."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams
    from pagedchat.model.loader import load_model

    loaded = load_model(spec["model"], spec["device"], spec["dtype"], spec.get("max_model_len"), show_progress=False)
    memory.start()   # everything below the weights counts: the KV pool, activations, bookkeeping
    config = EngineConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"],
                          block_size=spec["block_size"], num_blocks=spec["num_blocks"],
                          max_num_batched_tokens=spec["max_batched_tokens"],
                          max_num_seqs=max(256, len(spec["prompts"])), overlap=overlap)
    engine = Engine(config, loaded=loaded, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    engine.generate(spec["warmup"], params.with_(max_tokens=4))
    _sync(spec["device"])
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in spec["prompts"]]
    for _ in engine.steps():
        pass
    _sync(spec["device"])
    wall = time.perf_counter() - start
    outs = [engine.pop_output(i) for i in ids]
    result = {"wall_s": wall, "ttft_s": [o.ttft_s for o in outs], "outputs": [o.outputs[0].token_ids for o in outs],
              "preemptions": engine.scheduler.num_preemptions}
    if spec.get("profile"):
        result["profile"] = _profile_engine(Engine(config, loaded=loaded, show_progress=False), spec, params)
    return result


# Where an engine step's time goes, by the functions that own it (cumulative time, so callees count).
_PROFILE_BUCKETS = {
    "attention (paged kernels, torch path)": ("paged_decode_attention_ref", "paged_prefill_attention_ref",
                                              "paged_decode_attention_triton", "paged_prefill_attention_triton"),
    "KV writes and block copies": ("write_kv_ref", "write_kv_triton", "copy_blocks_all_layers"),
    "linear layers": ("<built-in method torch._C._nn.linear>",),
    "sampling": ("__call__",),
}


def _profile_engine(engine, spec: dict, params) -> dict:
    """The same batch again under cProfile (a fresh engine, so no prefix-cache hits): shares of step time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for p in spec["prompts"]:
        engine.add_request(p, params)
    profiler.enable()
    for _ in engine.steps():
        pass
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    cumulative = {}
    for (path, _, name), (_, _, _, cum, _) in stats.items():
        if name == "__call__" and not path.endswith("sampler.py"):
            continue
        cumulative[name] = cumulative.get(name, 0.0) + cum
    total = cumulative.get("step", 0.0)
    shares = {bucket: sum(cumulative.get(n, 0.0) for n in names) / total for bucket, names in _PROFILE_BUCKETS.items()}
    shares["everything else (scheduler, batch preparation, Python)"] = 1 - sum(shares.values())
    return {"step_s": total, "shares": shares}


class _FirstTokenClock:
    """A generate() streamer that notes when the batch's first new tokens come out (its first put() is the
    prompt, its second the first generated tokens)."""

    def __init__(self):
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def first_token_time(self) -> float | None:
        return self.puts[1] if len(self.puts) > 1 else None


def _padded_batch(prompts: list[list[int]], pad: int, device: str):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):   # left padding: every prompt ends where generation starts
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _top2_gaps():
    """A logits processor keeping each step's top-2 logit gap per row, on the device (no sync per step): at a
    greedy divergence it tells a near-tie, which rounding decides, from an error."""
    import torch
    from transformers import LogitsProcessor

    class Top2Gaps(LogitsProcessor):
        def __init__(self):
            self.steps: list[torch.Tensor] = []

        def __call__(self, input_ids, scores):
            top2 = scores.float().topk(2, dim=-1).values
            self.steps.append(top2[:, 0] - top2[:, 1])
            return scores

        def per_row(self) -> list[list[float]]:
            return torch.stack(self.steps, dim=1).tolist() if self.steps else []

    return Top2Gaps()


def worker_hf_generate(spec: dict, memory) -> dict:
    import torch
    from transformers import LogitsProcessorList

    model = _load_hf(spec)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    memory.start()
    n = spec["max_tokens"]

    def generate(prompts, new_tokens, streamer=None, gaps=None):
        ids, mask = _padded_batch(prompts, pad, spec["device"])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=None, streamer=streamer,
                                 logits_processor=LogitsProcessorList([gaps] if gaps else []))
        return out[:, ids.shape[1]:].tolist()

    generate(spec["warmup"], 4)
    clock, gaps = _FirstTokenClock(), _top2_gaps()
    _sync(spec["device"])
    start = time.perf_counter()
    outputs = generate(spec["prompts"], n, clock, gaps)
    _sync(spec["device"])
    wall = time.perf_counter() - start
    ttft = clock.first_token_time - start
    return {"wall_s": wall, "ttft_s": [ttft] * len(outputs), "outputs": outputs, "top2_gaps": gaps.per_row()}


def worker_hf_cb(spec: dict, memory) -> dict:
    from transformers import GenerationConfig

    model = _load_hf(spec)
    memory.start()
    n = spec["max_tokens"]
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1,
                           pad_token_id=model.config.pad_token_id or 0)
    with _cb_manager(model, gen, spec) as manager:
        _collect(manager, _add_cb_requests(manager, spec["warmup"], 4, "warmup"))
        _sync(spec["device"])
        start = time.perf_counter()
        ids = _add_cb_requests(manager, spec["prompts"], n, "req", timestamps=True)
        results = _collect(manager, ids)
        _sync(spec["device"])
        wall = time.perf_counter() - start
    outs = [results[i] for i in ids]
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"transformers continuous batching failed a request: {o.error}")
    # Older releases record no timestamps: no TTFT then.
    ttft = [o.timestamps[0] - start if getattr(o, "timestamps", None) else None for o in outs]
    return {"wall_s": wall, "ttft_s": ttft if None not in ttft else [], "outputs": [list(o.generated_tokens) for o in outs]}


def _accepted(fn, **kwargs) -> dict:
    """The keyword arguments `fn` takes (the continuous-batching API moved between transformers releases)."""
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


@contextlib.contextmanager
def _cb_manager(model, gen, spec: dict):
    """A running ContinuousBatchingManager with the same KV sizing as pagedchat's, on every transformers release
    that has one: from ~5.0 through a ContinuousBatchingConfig (its block size is `block_size`, `page_size` from
    5.17 on), before that through attributes of the GenerationConfig (4.54 .. 4.57). Releases before 4.54 have no
    continuous batching: the error says so, and the other systems are still measured."""
    import transformers

    sizing = dict(block_size=spec["block_size"], num_blocks=spec["num_blocks"],
                  max_batch_tokens=spec["max_batched_tokens"],
                  max_requests_per_batch=max(256, len(spec["prompts"])))
    if not hasattr(model, "init_continuous_batching"):
        raise RuntimeError(f"transformers {transformers.__version__} has no continuous batching (it came in 4.54)")
    config_class = getattr(transformers, "ContinuousBatchingConfig", None)
    if config_class is not None and hasattr(model, "continuous_batching_context_manager"):
        if "page_size" in _accepted(config_class, page_size=0):
            sizing["page_size"] = sizing.pop("block_size")
        config = config_class(**_accepted(config_class, **sizing))
        extra = _accepted(model.continuous_batching_context_manager, continuous_batching_config=config, block=True,
                          timeout=30, warmup=spec["device"].startswith("cuda"))
        with model.continuous_batching_context_manager(generation_config=gen, **extra) as manager:
            yield manager
        return
    for key, value in sizing.items():
        setattr(gen, key, value)   # the older manager reads its sizing from the generation config
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=True, timeout=30)


def _add_cb_requests(manager, prompts: list[list[int]], max_new_tokens: int, prefix: str,
                     timestamps: bool = False) -> list[str]:
    """One request per prompt under our own ids (some releases sort a batch added at once)."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        manager.add_request(prompt, **_accepted(manager.add_request, request_id=request_id,
                                                max_new_tokens=max_new_tokens, record_timestamps=timestamps))
    return ids


class _LastError(logging.Handler):
    """The last error transformers' continuous-batching loop logged (its thread dies with it, silently)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.message = "no error logged"

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage().splitlines()[0]


def _collect(manager, ids: list[str], timeout: float = 600) -> dict:
    wanted, results = set(ids), {}
    deadline = time.monotonic() + timeout
    cb_log, last_error = logging.getLogger("ContinuousBatchingLogger"), _LastError()
    cb_log.setLevel(logging.ERROR)   # quiet_transformers silences it, errors included
    cb_log.addHandler(last_error)
    while wanted - results.keys():
        if time.monotonic() > deadline or not manager.is_running():
            raise RuntimeError(f"transformers continuous batching stopped before finishing the requests "
                               f"({last_error.message})")
        result = manager.get_result(timeout=1)
        if result is not None and result.request_id in wanted and _finished(result):
            results[result.request_id] = result
    return results


def _finished(result) -> bool:
    if hasattr(result, "is_finished"):
        return result.is_finished()
    return getattr(result.status, "value", result.status) in ("finished", "failed")   # transformers 4.54 .. 4.57


WORKERS = {"pagedchat": worker_pagedchat, "pagedchat-sync": lambda spec, memory: worker_pagedchat(spec, memory, False),
           "hf-generate": worker_hf_generate, "hf-cb": worker_hf_cb}


def worker_main(system: str, spec_path: str, out_path: str) -> None:
    """Subprocess entry: load, warm up, run the batch once, write the measurements as JSON."""
    import torch

    from pagedchat.bench.common import PeakMemory

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    quiet_transformers()
    memory = PeakMemory(spec["device"])
    start = time.perf_counter()
    result = WORKERS[system](spec, memory)
    result.update(system=system, peak_memory_bytes=memory.peak_delta(), process_s=time.perf_counter() - start)
    Path(out_path).write_text(json.dumps(result))


# -- the parent: run the workers, compare -------------------------------------------------------------------
def _run_worker(system: str, spec_path: Path, workdir: Path, timeout: float) -> dict:
    out = workdir / f"{system}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "pagedchat.bench.throughput", system, str(spec_path), str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{system} did not finish within {timeout:.0f} s; use fewer --requests or --max-tokens") \
            from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{system} run failed: {tail[0]}")
    return json.loads(out.read_text())


def _summarize(runs: list[dict], max_tokens: int) -> dict:
    """The median-wall run of a system, with its rates and latency percentiles."""
    best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    tokens = sum(len(o) for o in best["outputs"])
    ttft = best["ttft_s"]
    return {"output_tokens": tokens, "wall_s": best["wall_s"], "output_tok_per_s": tokens / best["wall_s"],
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "peak_memory_mib": max(r["peak_memory_bytes"] for r in runs) / 2**20,
            "walls_s": [r["wall_s"] for r in runs], "all_max_tokens": all(len(o) == max_tokens for o in best["outputs"]),
            "outputs": best["outputs"], "top2_gaps": best.get("top2_gaps")}


def agreement(ours: list[list[int]], theirs: list[list[int]], their_gaps: list[list[float]] | None = None) -> dict:
    """Greedy outputs of the same prompt ids, request by request, compared over the tokens both produced (a
    system that stopped early at EOS is compared as far as it went): how many requests are identical, how many
    tokens agree before each request's first divergence, where those divergences fall, and, when the other
    system kept its top-2 logit gap at every step, that gap at each first divergence (a small gap is a near-tie
    that rounding decides; a large one is an error)."""
    firsts, agreeing, compared = [], 0, 0
    for row, (x, y) in enumerate(zip(ours, theirs)):
        both = min(len(x), len(y))
        first = next((i for i in range(both) if x[i] != y[i]), both)
        agreeing, compared = agreeing + first, compared + both
        if first < both:
            firsts.append((first, row))
    positions = [first for first, _ in firsts]
    result = {"identical": len(ours) - len(firsts), "of": len(ours), "agreeing_tokens": agreeing,
              "compared_tokens": compared, "first_divergence_min": min(positions) if positions else None,
              "first_divergence_median": percentile(positions, 50)}
    if their_gaps and firsts:
        gaps = [their_gaps[row][first] for first, row in firsts]
        result.update(divergence_top2_gap_median=percentile(gaps, 50), divergence_top2_gap_max=max(gaps))
    return result


def _run_all(systems: tuple[str, ...], spec: dict, repeats: int, timeout: float) -> tuple[dict, dict]:
    """Every system `repeats` times, in turns. A peer that fails is left out with its error (pagedchat's own
    failure fails the run): the other rows are still measured."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pagedchat-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for _ in range(repeats):
            for system in systems:
                if system in errors:
                    continue
                try:
                    runs[system].append(_run_worker(system, spec_path, Path(tmp), timeout))
                except UserError as e:
                    if system == "pagedchat":
                        raise
                    errors[system] = str(e)
    return {s: r for s, r in runs.items() if s not in errors}, errors


def run_throughput_bench(model_path: Path, model_name: str, requests: int = 16, max_tokens: int = 64,
                         mean_prompt: float = 128, max_prompt: int = 512, block_size: int = 16,
                         max_batched_tokens: int = 2048, device: str = "cpu", dtype: str = "auto",
                         systems: tuple[str, ...] = ("pagedchat", "hf-generate", "hf-cb"), repeats: int = 1,
                         seed: int = 0,
                         threads: int | None = None, timeout: float = 1800, profile: bool = False) -> dict:
    from transformers import AutoConfig

    from pagedchat.bench.common import machine_description, machine_info

    if requests < 1 or max_tokens < 1 or repeats < 1:
        raise UserError("--requests, --max-tokens and --repeats must be >= 1")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "pagedchat" not in systems:
        raise UserError(f"--systems must include pagedchat and be among {', '.join(SYSTEMS)}")
    config = AutoConfig.from_pretrained(model_path)
    limit = getattr(config, "max_position_embeddings", 4096)
    if max_prompt + max_tokens > limit:
        raise UserError(f"--max-prompt + --max-tokens ({max_prompt + max_tokens}) exceeds the model's context "
                        f"({limit})")
    prompts = make_prompts(requests, mean_prompt, max_prompt, config.vocab_size, seed)
    warmup = make_prompts(2, 16, 16, config.vocab_size, seed + 1)
    spec = {"model": str(model_path), "device": device, "dtype": dtype, "prompts": prompts, "warmup": warmup,
            "max_tokens": max_tokens, "block_size": block_size, "max_batched_tokens": max_batched_tokens,
            "num_blocks": kv_blocks_for(prompts, max_tokens, block_size), "threads": threads, "profile": profile}
    runs, errors = _run_all(systems, spec, repeats, timeout)
    summary = {s: _summarize(r, max_tokens) for s, r in runs.items()}
    profiles = [run["profile"] for run in runs["pagedchat"] if "profile" in run]
    ours = summary["pagedchat"]
    peers = [s for s in summary if s != "pagedchat"]
    hidden = ("outputs", "top2_gaps")
    result = {
        "model": model_name, "device": device, "machine": machine_description(), "machine_info": machine_info(),
        "requests": requests, "max_tokens": max_tokens, "prompt_tokens": [len(p) for p in prompts],
        "block_size": block_size, "kv_blocks": spec["num_blocks"], "repeats": repeats, "seed": seed,
        "threads": threads,
        "systems": {s: {k: v for k, v in summary[s].items() if k not in hidden} if s in summary
                    else {"error": errors[s]} for s in systems},
        "speedup": {s: ratio(ours["output_tok_per_s"], summary[s]["output_tok_per_s"]) for s in peers},
        "ttft_p50_ratio": {s: ratio(summary[s]["ttft_p50_s"], ours["ttft_p50_s"]) for s in peers},
        "memory_ratio": {s: ratio(summary[s]["peak_memory_mib"], ours["peak_memory_mib"]) for s in peers},
        "greedy_agreement": {s: agreement(ours["outputs"], summary[s]["outputs"], summary[s]["top2_gaps"])
                             for s in peers},
    }
    if profiles:
        result["pagedchat_profile"] = profiles[0]
    return result


def plot_throughput(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    names = [n for n in r["systems"] if "error" not in r["systems"][n]]
    short = {"pagedchat": "pagedchat", "pagedchat-sync": "pagedchat\n(not overlapped)",
             "hf-generate": "HF generate\n(padded)", "hf-cb": "HF continuous\nbatching"}
    labels = [short[n] for n in names]
    colors = ["tab:blue" if n == "pagedchat" else "tab:red" if n == "hf-generate" else "tab:orange" for n in names]
    panels = [("output tokens/s", "output_tok_per_s", 1), ("TTFT p50 (ms)", "ttft_p50_s", 1000),
              ("peak memory above weights (MiB)", "peak_memory_mib", 1)]
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4))
    for ax, (title, key, scale) in zip(axes, panels):
        ax.bar(range(len(names)), [r["systems"][n][key] * scale for n in names], color=colors)
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    lengths = r["prompt_tokens"]
    fig.suptitle(f"{r['model']} on {r['device']}: {r['requests']} prompts of {min(lengths)}..{max(lengths)} tokens, "
                 f"{r['max_tokens']} new tokens each", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _agreement_words(a: dict) -> str:
    words = f"{a['identical']}/{a['of']} identical"
    if a["compared_tokens"]:
        words += f", {a['agreeing_tokens'] / a['compared_tokens']:.0%} of tokens before the first divergence"
    if a["first_divergence_min"] is not None:
        words += f" (earliest at token {a['first_divergence_min']}"
        if a.get("divergence_top2_gap_max") is not None:
            words += (f"; its top-2 logit gap there: median {a['divergence_top2_gap_median']:.3g}, "
                      f"max {a['divergence_top2_gap_max']:.3g}")
        words += ")"
    return words


def print_throughput_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = []
    for s, m in r["systems"].items():
        if "error" in m:
            rows.append([LABELS[s], f"failed: {m['error']}", None, None, None, None])
            continue
        rows.append([LABELS[s], m["output_tok_per_s"], _ms(m["ttft_p50_s"]), _ms(m["ttft_p99_s"]),
                     m["peak_memory_mib"], 1.0 if s == "pagedchat" else r["speedup"][s]])
    agree = "; ".join(f"{LABELS[s]}: {_agreement_words(a)}" for s, a in r["greedy_agreement"].items())
    lengths = r["prompt_tokens"]
    print_table(f"Throughput: {r['model']} on {r['device']} — {r['requests']} prompts of {min(lengths)}.."
                f"{max(lengths)} tokens, {r['max_tokens']} new tokens each",
                ["system", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "peak mem MiB", "pagedchat speedup"],
                rows, caption=f"greedy outputs vs pagedchat — {agree or 'no peer'}.")
    print(f"machine: {r['machine']}")
    if "pagedchat_profile" in r:
        shares = r["pagedchat_profile"]["shares"]
        print_table("Where pagedchat's step time goes (cProfile, cumulative)", ["part", "share of step time"],
                    [[k, f"{v:.0%}"] for k, v in shares.items()])


if __name__ == "__main__":
    worker_main(*sys.argv[1:4])
