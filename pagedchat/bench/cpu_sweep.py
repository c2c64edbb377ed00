"""`pagedchat bench cpu-sweep`: decode speed on CPU at batch sizes 1 to 64, every path in one run.

Systems, each in its own process with the same thread count, taking turns (median of the runs):

  - pagedchat            what a user gets: per kind and size of step the path measured faster on this
                         machine (pagedchat/native/paths.py); each batch size is warmed until it has decided
  - pagedchat native     the native step at every batch size (PAGEDCHAT_NATIVE=always)
  - pagedchat torch      the torch path (PAGEDCHAT_NATIVE=0)
  - transformers         `generate` on one left-padded batch
  - llama.cpp F32        (--peer llama.cpp) its own multi-sequence batching through the C API, on the same weights
                         as GGUF (Q8_0 instead with --quantize int8, Q4_0 with int4)

Each row is decode only: the clock starts once every prompt of the batch has its first token, and a run decodes
at least 256 tokens (256 new tokens at batch 1, 32 per sequence from batch 8 on). Prompts are 16-64 tokens (a
short chat turn), so prefilling 64 of them does not dominate the run.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

NEW_TOKENS = 32       # per sequence, at least
MIN_DECODED = 256     # tokens a run decodes at the least: a batch-1 run of 32 tokens lasts ~0.1 s, and this
                      # machine class varies by more than 15% over spans that short
PROMPT_TOKENS = (16, 64)
WARM_STEPS = 12  # per batch size before its timed run: the path choice's trials (4 steps a path) are over
GGUF_TYPE = {None: "F32", "int8": "Q8_0", "int4": "Q4_0"}
PAGEDCHAT_PATHS = {"pagedchat": None, "pagedchat native": "always", "pagedchat torch": "0"}
SKIPPABLE = {"native": "pagedchat native", "torch": "pagedchat torch", "transformers": "transformers"}


def new_tokens(batch: int) -> int:
    """Tokens each sequence decodes at this batch size: 256 at batch 1 down to 32 from batch 8 on."""
    return max(NEW_TOKENS, -(-MIN_DECODED // batch))


def sweep_prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(batch)]


# -- the workers (each in its own process) --------------------------------------------------------------------
def worker_pagedchat(spec: dict) -> dict:
    from pagedchat.bench.batch1 import decode_rate_pagedchat
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    quantize = {"quantize": spec["quantize"]} if spec.get("quantize") else {}
    engine = Engine(EngineConfig(model=spec["model"], device="cpu", dtype="float32", max_num_seqs=max(spec["batches"]),
                                 num_blocks=max(spec["batches"]) * 8 + 64, block_size=16, **quantize),
                    show_progress=False)
    params = SamplingParams(temperature=0, ignore_eos=True)
    rates = {}
    for batch in spec["batches"]:
        prompts = sweep_prompts(batch, spec["vocab_size"], spec["seed"])
        engine.generate(prompts, params.with_(max_tokens=WARM_STEPS))  # warm-up (and the path trials)
        rates[str(batch)] = decode_rate_pagedchat(engine, prompts, params.with_(max_tokens=new_tokens(batch)))
    native = engine.runner.native
    chosen = dict(native.paths.decided) if native is not None else {}
    return {"decode_tok_per_s": rates, "native_bound": native is not None, "paths": chosen}


def worker_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedchat.bench.batch1 import _hf_decode_rate, _hf_timed_generate

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    rates = {}
    for batch in spec["batches"]:
        prompts = sweep_prompts(batch, spec["vocab_size"], spec["seed"])
        _hf_timed_generate(model, prompts, 2)  # warm-up
        rates[str(batch)] = _hf_decode_rate(model, prompts, new_tokens(batch))
    return {"decode_tok_per_s": rates}


def worker_llama_cpp(spec: dict) -> dict:
    from pagedchat.bench.batch1 import decode_rate_llama_cpp

    rates = {}
    for batch in spec["batches"]:
        prompts = sweep_prompts(batch, spec["vocab_size"], spec["seed"])
        decode_rate_llama_cpp(spec["gguf"], prompts[:1], 2, spec["threads"])  # warm-up
        rates[str(batch)] = decode_rate_llama_cpp(spec["gguf"], prompts, new_tokens(batch), spec["threads"])
    return {"decode_tok_per_s": rates}


WORKERS = {"pagedchat": worker_pagedchat, "transformers": worker_transformers, "llama.cpp": worker_llama_cpp}


def worker_main(system: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    from pagedchat.bench.common import quiet_transformers

    quiet_transformers()
    Path(out_path).write_text(json.dumps(WORKERS[system](spec)))


# -- the parent -----------------------------------------------------------------------------------------------
def _run(name: str, spec: dict, workdir: Path, timeout: float) -> dict:
    """One system's run in its own process, PAGEDCHAT_NATIVE as the system asks (unset: the measured choice)."""
    from pagedchat.bench.common import run_worker

    env = {k: v for k, v in os.environ.items() if k != "PAGEDCHAT_NATIVE"}
    if spec.get("native"):
        env["PAGEDCHAT_NATIVE"] = spec["native"]
    return run_worker("pagedchat.bench.cpu_sweep", name.split()[0], spec, workdir, timeout, f"cpu-sweep: the {name}",
                      env)


def run_cpu_sweep(model_path: Path, threads: int, batches: list[int], repeats: int = 3, quantize: str | None = None,
                  peer: str | None = None, seed: int = 0, timeout: float = 1800, skip: tuple[str, ...] = ()) -> dict:
    """Every system at every batch size, the systems taking turns; the median of each counts. `skip` leaves
    out rows by their SKIPPABLE name (on a 1B model the torch path and transformers take most of an hour)."""
    from pagedchat.bench.batch1 import llama_cpp_available, write_gguf

    config = json.loads((Path(model_path) / "config.json").read_text())
    base = {"model": str(model_path), "threads": threads, "batches": batches,
            "vocab_size": config["vocab_size"], "seed": seed, "quantize": quantize}
    systems = {name: {**base, "native": native} for name, native in PAGEDCHAT_PATHS.items()}
    systems["transformers"] = dict(base)
    for name in skip:
        del systems[SKIPPABLE[name]]
    notes = []
    with tempfile.TemporaryDirectory(prefix="pagedchat-cpu-sweep-") as tmp:
        if peer == "llama.cpp":
            if llama_cpp_available():
                kind = GGUF_TYPE[quantize]
                path = write_gguf(Path(model_path), Path(tmp) / f"model-{kind}.gguf", kind)
                systems[f"llama.cpp {kind}"] = {**base, "gguf": str(path)}
            else:
                notes.append("llama.cpp peer skipped: llama-cpp-python (and gguf) are not installed")
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        for _ in range(repeats):
            for name, spec in systems.items():
                runs[name].append(_run(name, spec, Path(tmp), timeout))
    table = {name: {str(b): statistics.median(r["decode_tok_per_s"][str(b)] for r in rs) for b in batches}
             for name, rs in runs.items()}
    paths = runs["pagedchat"][-1].get("paths", {})
    return {"threads": threads, "repeats": repeats, "batches": batches,
            "new_tokens": {str(b): new_tokens(b) for b in batches},
            "prompt_tokens": list(PROMPT_TOKENS), "quantize": quantize, "decode_tok_per_s": table,
            "runs": {name: [r["decode_tok_per_s"] for r in rs] for name, rs in runs.items()},
            "native_bound": runs["pagedchat"][-1].get("native_bound"), "paths_chosen": paths, "notes": notes}


def print_cpu_sweep_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    table, names = r["decode_tok_per_s"], list(r["decode_tok_per_s"])
    peers = [n for n in names if not n.startswith("pagedchat")]
    rows, both = [], has_both_paths(r)
    for b in r["batches"]:
        b = str(b)
        ours = table["pagedchat"][b]
        paths = [table["pagedchat native"][b] / table["pagedchat torch"][b],
                 ours / max(table["pagedchat native"][b], table["pagedchat torch"][b])] if both else []
        rows.append([int(b), *(table[n][b] for n in names), *paths, *(ours / table[n][b] for n in peers)])
    ratios = ["native / torch", "pagedchat / faster path"] if both else []
    print_table(f"Decode tok/s by batch size ({_tokens_text(r)} after {r['prompt_tokens'][0]}-"
                f"{r['prompt_tokens'][1]}-token prompts, decode only); {r['threads']} thread(s), median of "
                f"{r['repeats']} alternating runs" + (f"; --quantize {r['quantize']}" if r["quantize"] else ""),
                ["batch", *names, *ratios, *(f"pagedchat / {n}" for n in peers)],
                rows, caption="pagedchat: the path measured faster per step size (its choices: paths_chosen)")
    for note in r["notes"]:
        print(note)
    if "machine" in r:
        print(f"machine: {r['machine']}")


def has_both_paths(r: dict) -> bool:
    """Whether the run timed the native step and the torch path on their own (neither was skipped)."""
    return {"pagedchat native", "pagedchat torch"} <= set(r["decode_tok_per_s"])


def _tokens_text(r: dict) -> str:
    counts = sorted(set(r["new_tokens"].values()))
    return f"{counts[0]} new tokens each" if len(counts) == 1 else f"{counts[-1]}-{counts[0]} new tokens each"


if __name__ == "__main__":
    worker_main(*sys.argv[1:4])
