"""Real GGUF models against llama.cpp on the same file, same thread count, alternating runs, medians:
load to first token of a one-shot run, peak resident memory, batch-1 decode and a 512-token prefill.

    python scripts/bench_real_models.py [--threads 1] [--repeats 3] [--json]

With --json the result (both models, their command, date and machine) goes to stdout as one JSON object, which
scripts/run_benchmarks.sh files as docs/bench-results/real-models-ISA.json; without it, a short table.

Each measurement runs in a fresh process (a worker mode of this script), pagedchat and llama.cpp in turn.
pagedchat runs the file twice: in its own block formats (the default) and dequantized (`--quantize none`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper."
DECODE_TOKENS = 128
PREFILL_TOKENS = 512


def _worker_pagedchat(path: str, quantize: str | None, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    start = time.perf_counter()
    eng = Engine(EngineConfig(model=path, device="cpu", quantize=quantize, kv_memory="256MiB"), show_progress=False)
    load_s = time.perf_counter() - start
    tok = eng.tokenizer
    prompt = tok.encode(PROMPT)
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm-up
    start = time.perf_counter()
    out = eng.generate([prompt[::-1] + prompt], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS,
                                                                ignore_eos=True))[0]
    total = time.perf_counter() - start
    decode_tps = (DECODE_TOKENS - 1) / (total - out.ttft_s) if out.ttft_s else None
    long = (tok.encode(PROMPT * 64))[:PREFILL_TOKENS]
    start = time.perf_counter()
    eng.generate([long], SamplingParams(temperature=0, max_tokens=1))
    return {"load_s": load_s, "decode_tok_s": decode_tps, "prefill_512_s": time.perf_counter() - start}


def _worker_llama_cpp(path: str, threads: int) -> dict:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                verbose=False)
    load_s = time.perf_counter() - start
    prompt = llm.tokenize(PROMPT.encode())
    llm.eval(prompt)   # warm-up
    llm.reset()
    seq = prompt[::-1] + prompt
    llm.eval(seq)
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS - 1):
        token = int(llm.scores[llm.n_tokens - 1].argmax())   # greedy, as pagedchat's run
        llm.eval([token])
    decode_tps = (DECODE_TOKENS - 1) / (time.perf_counter() - start)
    long = llm.tokenize((PROMPT * 64).encode())[:PREFILL_TOKENS]
    llm.reset()
    start = time.perf_counter()
    llm.eval(long)
    return {"load_s": load_s, "decode_tok_s": decode_tps, "prefill_512_s": time.perf_counter() - start}


def _one_shot(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak resident bytes) of one process that loads the model and prints one token: run by a
    wrapper process that runs only it, so the wrapper's children's peak is this command's."""
    wrapper = [sys.executable, "-c", "import resource, subprocess, sys, time; t = time.perf_counter(); "
               "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(done.stderr) if done.returncode else None; "
               "print(done.returncode, time.perf_counter() - t, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)", *cmd]
    out = subprocess.run(wrapper, capture_output=True, text=True)
    code, seconds, rss = out.stdout.split()
    if code != "0":
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return float(seconds), int(rss)


def _oneshots(path: str, threads: int) -> dict[str, list[str]]:
    llama = ("from llama_cpp import Llama; import sys; "
             f"l = Llama(model_path={path!r}, n_threads={threads}, n_ctx=512, verbose=False); "
             "print(l.create_completion('hi', max_tokens=1, temperature=0)['choices'][0]['text'])")
    return {"pagedchat": [sys.executable, "-m", "pagedchat.cli", "run", "-m", path, "--threads", str(threads),
                          "--kv-memory", "64MiB", "--max-tokens", "1", "--temperature", "0", "--raw", "hi"],
            "llama.cpp": [sys.executable, "-c", llama]}


def measure(path: str, threads: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"pagedchat (file formats)": [], "pagedchat (--quantize none)": [],
                                   "llama.cpp": []}
    workers = {"pagedchat (file formats)": ["pagedchat", "file"], "pagedchat (--quantize none)": ["pagedchat", "none"],
               "llama.cpp": ["llama.cpp", "-"]}
    oneshot: dict[str, list[float]] = {"pagedchat": [], "llama.cpp": []}
    rss: dict[str, list[int]] = {"pagedchat": [], "llama.cpp": []}
    for _ in range(repeats):   # alternating: the machine's drift hits every system alike
        for name, (system, q) in workers.items():
            cmd = [sys.executable, __file__, "--worker", system, "--quantize", q, "--threads", str(threads), path]
            runs[name].append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
        for name, cmd in _oneshots(path, threads).items():
            seconds, peak = _one_shot(cmd)
            oneshot[name].append(seconds)
            rss[name].append(peak)
    med = lambda xs: statistics.median(x for x in xs if x is not None)  # noqa: E731
    out = {name: {k: med([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    return {"systems": out, "run_to_first_token_s": {k: med(v) for k, v in oneshot.items()},
            "peak_rss_bytes": {k: med(v) for k, v in rss.items()}, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    ap.add_argument("--worker")
    ap.add_argument("--quantize")
    ap.add_argument("paths", nargs="*")
    a = ap.parse_args()
    if a.worker:
        q = None if a.quantize == "file" else a.quantize
        result = _worker_pagedchat(a.paths[0], q, a.threads) if a.worker == "pagedchat" else \
            _worker_llama_cpp(a.paths[0], a.threads)
        print(json.dumps(result))
        return
    from pagedchat.bench.common import machine_description
    from pagedchat.bench.real_models import MODELS, fetch

    paths = a.paths or [str(fetch(m)) for m in MODELS.values()]
    command = f"python scripts/bench_real_models.py --threads {a.threads} --repeats {a.repeats}"
    report = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine_description(),
              "threads": a.threads, "repeats": a.repeats, "models": {}}
    for path in paths:
        report["models"][Path(path).name] = measure(path, a.threads, a.repeats)
    if a.json:
        print(json.dumps(report, indent=1))
        return
    for name, r in report["models"].items():
        print(f"\n{name} ({a.threads} thread(s), median of {a.repeats})")
        for system, s in r["systems"].items():
            print(f"  {system:30s} load {s['load_s']:.2f} s  decode {s['decode_tok_s']:.1f} tok/s  "
                  f"prefill 512 {s['prefill_512_s']:.2f} s")
        print("  run to first token: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["run_to_first_token_s"].items()))
        print("  peak RSS: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["peak_rss_bytes"].items()))

if __name__ == "__main__":
    main()
