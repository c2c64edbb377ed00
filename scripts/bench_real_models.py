"""Real GGUF models against llama.cpp on the same file, same thread count, alternating runs, medians:
load to first token of a one-shot run, peak resident memory, batch-1 decode, 16 sequences decoding together
(llama.cpp: 16 parallel sequences in one batch, as its `batched` example runs them) and a 512-token prefill.

    python scripts/bench_real_models.py [--threads 1] [--repeats 3] [--json] [--llama-1b]

With --json the result (both models, their command, date and machine) goes to stdout as one JSON object, which
scripts/run_benchmarks.sh files as docs/bench-results/real-models-ISA.json; without it, a short table.

Each measurement runs in a fresh process (a worker mode of this script), pagedchat and llama.cpp in turn.
pagedchat runs the file twice: in its own block formats (the default) and dequantized (`--quantize none`).

--llama-1b adds batch-1 decode of a Llama-3.2-1B-shaped Q4_K_M file (random blocks in Q4_K_M's types, written
once into ~/.cache/pagedchat/bench by pagedchat/bench/gguf_writer.py): a model whose weights stream from memory
at every step (0.8 GB), where the two real files mostly fit in the CPU's caches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper."
DECODE_TOKENS = 128
PREFILL_TOKENS = 512
PARALLEL = 16          # sequences decoding together
PARALLEL_TOKENS = 64   # new tokens per sequence there


def _parallel_prompts() -> list[str]:
    """PARALLEL different prompts (no shared prefix beyond the first words: the decode is what is timed)."""
    return [f"{PROMPT} Number {i}: it begins on a {day}." for i, day in
            zip(range(PARALLEL), ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"] * 3)]


def _pagedchat_parallel_decode(eng, tok) -> float:
    """Tokens per second of PARALLEL greedy sequences decoding together, from the last first token on (every
    prompt is prefilled in the first step or two, then all decode in one batch)."""
    from pagedchat.engine import SamplingParams

    prompts = [tok.encode(text) for text in _parallel_prompts()]
    params = SamplingParams(temperature=0, max_tokens=PARALLEL_TOKENS, ignore_eos=True)
    eng.generate([p[:-1] for p in prompts], params)   # warm-up: the batch sizes' paths decided (native/paths.py)
    start = time.perf_counter()
    outs = eng.generate(prompts, params)
    total = time.perf_counter() - start
    return PARALLEL * (PARALLEL_TOKENS - 1) / (total - max(out.ttft_s for out in outs))


def _worker_pagedchat(path: str, quantize: str | None, threads: int, decode_only: bool) -> dict:
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
    if decode_only:
        return {"load_s": load_s, "decode_tok_s": decode_tps}
    long = (tok.encode(PROMPT * 64))[:PREFILL_TOKENS]
    start = time.perf_counter()
    eng.generate([long], SamplingParams(temperature=0, max_tokens=1))
    prefill_s = time.perf_counter() - start
    return {"load_s": load_s, "decode_tok_s": decode_tps, "prefill_512_s": prefill_s,
            "decode_16_tok_s": _pagedchat_parallel_decode(eng, tok)}


def _worker_llama_cpp(path: str, threads: int, decode_only: bool) -> dict:
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
        llm.eval([_greedy(llm._ctx.ctx, -1, llm.n_vocab())])   # greedy, as pagedchat's run
    decode_tps = (DECODE_TOKENS - 1) / (time.perf_counter() - start)
    if decode_only:
        return {"load_s": load_s, "decode_tok_s": decode_tps}
    long = llm.tokenize((PROMPT * 64).encode())[:PREFILL_TOKENS]
    llm.reset()
    start = time.perf_counter()
    llm.eval(long)
    prefill_s = time.perf_counter() - start
    return {"load_s": load_s, "decode_tok_s": decode_tps, "prefill_512_s": prefill_s,
            "decode_16_tok_s": _llama_cpp_parallel_decode(llm._model.model, threads)}


def _greedy(ctx, row: int, n_vocab: int) -> int:
    """The argmax of llama.cpp's logits for batch row `row` (-1: the last). Read from the context itself:
    llama-cpp-python's `Llama.scores` holds logits only with logits_all=True, and is zeros otherwise."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    logits = ctypes.cast(lc.llama_get_logits_ith(ctx, row), ctypes.POINTER(ctypes.c_float))
    return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())


def _llama_cpp_parallel_decode(model, threads: int) -> float:
    """llama.cpp's own way of decoding several sequences together (its `batched` example): one context with
    PARALLEL sequence ids, every prompt in one batch, then one batch of PARALLEL tokens per step, greedy.
    Tokens per second from the first decode batch on."""
    import llama_cpp as lc

    vocab = lc.llama_model_get_vocab(model)
    prompts = []
    for text in _parallel_prompts():
        data, ids = text.encode(), (lc.llama_token * 512)()
        prompts.append(list(ids[:lc.llama_tokenize(vocab, data, len(data), ids, 512, True, False)]))
    params = lc.llama_context_default_params()
    params.n_seq_max, params.n_threads, params.n_threads_batch = PARALLEL, threads, threads
    params.n_ctx = PARALLEL * (max(map(len, prompts)) + PARALLEL_TOKENS + 16)
    params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
    params.kv_unified = True   # one cache for all sequences, as pagedchat's pool (and the example's default)
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(params.n_batch, 0, PARALLEL)
    n_vocab = lc.llama_vocab_n_tokens(vocab)

    def decode(rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits); returns the greedy next token of each wanted row."""
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama.cpp: llama_decode failed")
        return [_greedy(ctx, i, n_vocab) for i, row in enumerate(rows) if row[3]]

    try:
        nxt = decode([(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)])
        start = time.perf_counter()
        for step in range(PARALLEL_TOKENS - 1):
            nxt = decode([(nxt[seq], len(p) + step, seq, True) for seq, p in enumerate(prompts)])
        return PARALLEL * (PARALLEL_TOKENS - 1) / (time.perf_counter() - start)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)


# One-shot runs take about a second, and this machine's speed drifts between consecutive runs by more than the
# systems differ: more alternating pairs than the longer measurements need.
ONESHOT_REPEATS = 7


def _one_shot(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak resident bytes) of one process that loads the model and prints one token: run by a
    wrapper process that runs only it, so the wrapper's children's peak is this command's."""
    wrapper = [sys.executable, "-c", "import resource, subprocess, sys, time; t = time.perf_counter(); "
               "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(done.stderr) if done.returncode else None; "
               "print(done.returncode, time.perf_counter() - t, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)", *cmd]
    # Bytecode as an installed package has it: pip compiles every module at install, and an environment that
    # forbids writing .pyc files would make both systems' Python code compile on every start instead.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(wrapper, capture_output=True, text=True, env=env)
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


def measure(path: str, threads: int, repeats: int, decode_only: bool = False) -> dict:
    """Every system on `path`, `repeats` times in turn; decode_only: batch-1 decode of pagedchat (file formats)
    and llama.cpp only."""
    workers = {"pagedchat (file formats)": ["pagedchat", "file"], "pagedchat (--quantize none)": ["pagedchat", "none"],
               "llama.cpp": ["llama.cpp", "-"]}
    if decode_only:
        del workers["pagedchat (--quantize none)"]
    runs: dict[str, list[dict]] = {name: [] for name in workers}
    oneshot: dict[str, list[float]] = {"pagedchat": [], "llama.cpp": []}
    rss: dict[str, list[int]] = {"pagedchat": [], "llama.cpp": []}
    for _ in range(repeats):   # alternating: the machine's drift hits every system alike
        for name, (system, q) in workers.items():
            cmd = [sys.executable, __file__, "--worker", system, "--quantize", q, "--threads", str(threads), path,
                   *(["--decode-only"] if decode_only else [])]
            runs[name].append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
    if not decode_only:
        for cmd in _oneshots(path, threads).values():   # untimed: bytecode written, the file in the page cache
            _one_shot(cmd)
        for _ in range(max(repeats, ONESHOT_REPEATS)):
            for name, cmd in _oneshots(path, threads).items():
                seconds, peak = _one_shot(cmd)
                oneshot[name].append(seconds)
                rss[name].append(peak)
    med = lambda xs: statistics.median(x for x in xs if x is not None)  # noqa: E731
    out = {name: {k: med([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    if decode_only:
        return {"systems": out, "runs": runs}
    return {"systems": out, "run_to_first_token_s": {k: med(v) for k, v in oneshot.items()},
            "peak_rss_bytes": {k: med(v) for k, v in rss.items()}, "runs": runs, "run_to_first_token_runs": oneshot}


def _llama_1b_file() -> Path:
    """The Llama-3.2-1B-shaped Q4_K_M file, written once (random blocks: speed depends on shapes and formats)."""
    from pagedchat.bench.gguf_writer import write_llama_q4_k_m

    path = Path.home() / ".cache" / "pagedchat" / "bench" / "llama-3.2-1b-shape.Q4_K_M.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_llama_q4_k_m(partial)
        partial.rename(path)
    return path


def _builds() -> dict:
    """What each side's compiled code targets: the ISA a figure belongs to is the build's, not only the CPU's
    (PAGEDCHAT_NATIVE_CFLAGS=-march=haswell and an AVX2 llama.cpp measure the AVX2 paths on an AVX-512 CPU)."""
    from pagedchat.native import build

    lib = build.load(wait=True)
    builds = {"pagedchat": build.build_info(lib) if lib is not None else build.status(),
              "pagedchat_flags": os.environ.get(build.FLAGS_ENV) or "-march=native"}
    try:
        import llama_cpp

        builds["llama_cpp"] = f"{llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}"
    except ImportError:
        builds["llama_cpp"] = None
    return builds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    ap.add_argument("--llama-1b", action="store_true", help="also a Llama-3.2-1B-shaped Q4_K_M file (decode)")
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker")
    ap.add_argument("--quantize")
    ap.add_argument("paths", nargs="*")
    a = ap.parse_args()
    if a.worker:
        q = None if a.quantize == "file" else a.quantize
        result = _worker_pagedchat(a.paths[0], q, a.threads, a.decode_only) if a.worker == "pagedchat" else \
            _worker_llama_cpp(a.paths[0], a.threads, a.decode_only)
        print(json.dumps(result))
        return
    from pagedchat.bench.common import machine_description
    from pagedchat.bench.real_models import MODELS, fetch

    paths = a.paths or [str(fetch(m)) for m in MODELS.values()]
    from pagedchat.native.build import FLAGS_ENV

    flags = os.environ.get(FLAGS_ENV)
    command = (f"{FLAGS_ENV}='{flags}' " if flags else "") \
        + f"python scripts/bench_real_models.py --threads {a.threads} --repeats {a.repeats}" \
        + (" --llama-1b" if a.llama_1b else "")
    report = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine_description(),
              "builds": _builds(), "threads": a.threads, "repeats": a.repeats, "models": {}}
    for path in paths:
        report["models"][Path(path).name] = measure(path, a.threads, a.repeats)
    if a.llama_1b:
        path = _llama_1b_file()
        report["shapes"] = {path.name: measure(str(path), a.threads, a.repeats, decode_only=True)}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    for name, r in report["models"].items():
        print(f"\n{name} ({a.threads} thread(s), median of {a.repeats})")
        for system, s in r["systems"].items():
            print(f"  {system:30s} load {s['load_s']:.2f} s  decode {s['decode_tok_s']:.1f} tok/s  "
                  f"{PARALLEL} sequences {s['decode_16_tok_s']:.1f} tok/s  prefill 512 {s['prefill_512_s']:.2f} s")
        print("  run to first token: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["run_to_first_token_s"].items()))
        print("  peak RSS: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["peak_rss_bytes"].items()))
    for name, r in report.get("shapes", {}).items():
        print(f"\n{name}: batch-1 decode " + ", ".join(f"{system} {s['decode_tok_s']:.1f} tok/s"
                                                        for system, s in r["systems"].items()))

if __name__ == "__main__":
    main()
