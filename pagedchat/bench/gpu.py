"""One command measures the GPU: `scripts/gpu_check.sh [OUTDIR]` (or `python -m pagedchat.bench.gpu OUTDIR`).

GPU time is lent minutes at a time, so everything GPU-side is measured by one prepared run. On a machine with
CUDA torch, triton and transformers and this project copied in, with no network, it runs these steps in order,
each in its own process under its own time limit, all within one overall budget (a rerun must fit too):

  install     pip install --no-deps --no-build-isolation --no-index -e .   (nothing is downloaded)
  tests       the `gpu` tests (in pytest-xdist workers where installed): every family fp32-exact against
              transformers on the same GPU (long prompts through a small step budget, the prefix cache, n=4, a
              7-head MHA Qwen2 shape), bf16 agreement, graph capture of every family, memory given back by
              close(), the kernel tests (attention, GGUF and int4 matmuls, fused layers, fp8/int8 KV), GGUF
              files' models on the GGUF matmuls in CUDA graphs; each outcome is streamed to a file as it comes
  model       a random model of Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads of 64, vocab 128,256,
              tied, bf16), built on the GPU once for the two steps below
  batch1      batch-1 decode (CUDA graphs on and off, `--quantize int4`, the same shape as a Q4_K_M GGUF file on
              the Triton GGUF kernels: needs gguf-py to write it, steps not overlapped) and time to first token of
              a 2,048-token prompt, against transformers `generate` and the memory-bandwidth floor
  throughput  `bench throughput`: 256 requests x 128 new tokens, pagedchat with steps overlapped and not
  kernels     `bench kernels`: the decode batch sweep (its headline: batch 64, 4k context) and the prefill cases,
              both attention generations (v1, v2) side by side
  spec        `bench spec` on the demo model: `--speculate ngram` against plain decode (edit-like, regenerate and
              plain workloads at batch 1 and 8), greedy tokens compared
  gguf        `bench gguf`: the Triton GGUF matmuls of the model's shape as Q4_K_M at batch 1, each layer's
              current, former and candidate tiles, and one step's matmuls in a CUDA graph against bf16 (last: where
              the budget runs out first, `--only gguf` runs it alone)

and writes OUTDIR/gpu-check.json (date, git revision, GPU, driver, versions, each step's status, time, error
and figures; rewritten after every step, so a run cut short keeps what it measured; a step stopped at its limit
keeps the rows it finished, which the benchmarks print as they go) and prints a short table.
Each step's output is kept in OUTDIR/logs/. Without a GPU the run stops with one line before any step;
`--dry-run` runs the same plan on CPU with each step's work replaced by what a CPU can check in seconds (the
install resolved but not made, the GPU tests collected, canned figures read back), so the plan, the JSON writer
and the table are exercised without a GPU.

Nothing here imports the server's or the REPL's dependencies (fastapi, uvicorn, prompt_toolkit, llguidance).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagedchat.bench.common import PARTIAL_ENV, partial_rows

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 560          # the whole run, steps included: under 10 minutes (a lent GPU's call), start-up aside
MIN_STEP_S = 20         # a step that would get less is skipped, not started
OUTCOMES = "gpu-tests.jsonl"   # each test's outcome as it comes (tests/conftest.py), kept when the step is cut
GPU_TESTS = ("tests/test_gpu_engine.py", "tests/test_kernels.py", "tests/test_triton_gguf.py", "tests/test_int4.py",
             "tests/test_fused_kernels.py", "tests/test_gguf_quants.py", "tests/test_gguf_families.py",
             "tests/test_kv_dtype.py")
MODEL_SHAPE = dict(arch="llama", size="1b", max_positions=4096)
# transformers' peers are left out: neither finished 256 x 128 within 40 s on an H100 (the goal is absolute)
THROUGHPUT_ARGS = ("--requests", "256", "--max-tokens", "128", "--systems", "pagedchat,pagedchat-sync")


@dataclass
class Step:
    name: str
    limit_s: float
    argv: list[str]                      # run from the repository root
    read: Callable[[str, Path], dict]    # (stdout, outdir) -> the step's figures
    dry_argv: list[str] = field(default_factory=list)   # what --dry-run runs instead (CPU, seconds)
    env: dict[str, str] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()        # files it writes in OUTDIR: removed first, so a rerun reads only its own
    # the figures of the rows a cut run finished (bench.common.report_partial), when it printed no JSON
    read_partial: Callable[[list[dict], Path], dict] | None = None


# -- reading each step's output ----------------------------------------------------------------------------
def _json_out(stdout: str, outdir: Path):
    """The JSON document a `--json` command printed, after whatever warnings came before it."""
    decoder, offset = json.JSONDecoder(), 0
    for line in stdout.splitlines(keepends=True):
        if line.startswith(("{", "[")):
            try:
                return decoder.raw_decode(stdout, offset)[0]
            except json.JSONDecodeError:
                pass
        offset += len(line)
    raise ValueError("no JSON document in the output")


def read_tests(stdout: str, outdir: Path) -> dict:
    """Counts and failures from pytest's JUnit XML (the failure message is where a divergence is explained)."""
    path = outdir / "gpu-tests.xml"
    if not path.exists():
        if (outdir / OUTCOMES).exists():    # stopped at its limit: the outcomes streamed until then
            return read_outcomes(outdir / OUTCOMES)
        # --collect-only (the dry run) writes no report: count what was collected
        return {"collected": sum(1 for line in stdout.splitlines() if "::" in line)}
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                             "message": (problem.get("message") or "")[:2000]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def read_outcomes(path: Path) -> dict:
    """The outcomes tests/conftest.py streamed (one JSON line per test) of a run that did not finish."""
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for line in path.read_text().splitlines():
        outcome = json.loads(line)
        counts["failed" if outcome["outcome"] == "error" else outcome["outcome"]] += 1
        if outcome["outcome"] in ("failed", "error"):
            failures.append({"test": outcome["test"], "message": outcome["message"]})
    return {**counts, "failures": failures, "unfinished": True}


def read_batch1(stdout: str, outdir: Path) -> dict:
    r = _json_out(stdout, outdir)
    systems = r["systems"]
    ours, off, sync, int4, gguf, hf = (systems.get(k, {}) for k in ("pagedchat", "pagedchat, graphs off",
                                                                      "pagedchat, not overlapped", "pagedchat int4",
                                                                      "pagedchat gguf q4_k_m", "transformers generate"))
    floor = r.get("floor") or {}
    return {"decode_tok_per_s": ours.get("decode_tok_per_s"), "decode_graphs_off_tok_per_s": off.get("decode_tok_per_s"),
            "decode_not_overlapped_tok_per_s": sync.get("decode_tok_per_s"),
            "overlap_speedup": _over(ours, sync, "decode_tok_per_s"),
            "int4_decode_tok_per_s": int4.get("decode_tok_per_s"),
            "int4_over_model_dtype": _over(int4, ours, "decode_tok_per_s"),
            # the goal: >= 2.5x the model dtype (bf16) at batch 1, from reading under a third of its bytes
            "gguf_q4_k_m_decode_tok_per_s": gguf.get("decode_tok_per_s"),
            "gguf_q4_k_m_over_model_dtype": _over(gguf, ours, "decode_tok_per_s"),
            "gguf_q4_k_m_of_floor": gguf.get("of_floor"), "gguf_q4_k_m_weight_bytes": gguf.get("weight_bytes"),
            "hf_decode_tok_per_s": hf.get("decode_tok_per_s"), "floor_tok_per_s": floor.get("tok_per_s"),
            "of_floor": ours.get("of_floor"), "copy_gbps": floor.get("copy_gbps"),
            "weight_bytes": floor.get("weight_bytes"), "ttft_ms": _ms(ours.get("ttft_s")),
            "hf_ttft_ms": _ms(hf.get("ttft_s")), "errors": {k: v["error"] for k, v in systems.items() if "error" in v},
            "result": r}


def read_batch1_partial(rows: list[dict], outdir: Path) -> dict:
    floor = next((row["floor"] for row in reversed(rows) if row.get("floor")), None)
    systems = {row["system"]: {k: v for k, v in row.items() if k not in ("system", "floor")} for row in rows}
    return read_batch1(json.dumps({"systems": systems, "floor": floor}), outdir)


def _over(a: dict, b: dict, key: str) -> float | None:
    """a[key] / b[key], or None when either row has no such figure (it failed)."""
    return a[key] / b[key] if a.get(key) and b.get(key) else None


def read_throughput(stdout: str, outdir: Path) -> dict:
    r = _json_out(stdout, outdir)
    rates = {s: m.get("output_tok_per_s") for s, m in r["systems"].items()}
    return {"tok_per_s": rates, "speedup": r["speedup"], "ttft_p50_ms": {s: _ms(m.get("ttft_p50_s"))
                                                                        for s, m in r["systems"].items()},
            "greedy_agreement": r["greedy_agreement"],
            "errors": {s: m["error"] for s, m in r["systems"].items() if "error" in m}, "result": r}


def read_spec(stdout: str, outdir: Path) -> dict:
    r = _json_out(stdout, outdir)
    at_1 = {row["workload"]: row for row in r["rows"] if row["batch"] == 1}
    return {"speedup_batch1": {w: row["speedup"] for w, row in at_1.items()},
            "acceptance_batch1": {w: row["acceptance_rate"] for w, row in at_1.items()},
            "greedy_identical": all(row["greedy_identical"] is not False for row in r["rows"]), "rows": r["rows"]}


def read_kernels(stdout: str, outdir: Path) -> dict:
    """Per attention generation (v1, v2): the decode headline (batch 64, 4k context) against copy bandwidth and
    SDPA, and whole-prompt prefill of 4k and 16k tokens against SDPA: the figures the kernel goals name."""
    r = _json_out(stdout, outdir)
    rows = r.get("measurements", r) if isinstance(r, dict) else r
    copy = next((row for row in rows if row.get("kernel") == "device_copy"), {})
    impls = {}
    for row in rows:
        impl = row.get("impl")
        if row.get("kernel") == "decode" and row.get("sweep") == "batch" and row.get("batch") == 64:
            impls.setdefault(impl, {}).update(decode_copy_frac=row.get("copy_frac"), decode_vs_sdpa=row.get("vs_sdpa"))
        elif (row.get("kernel") == "prefill" and row.get("batch") == 1 and row.get("new_tokens") == row.get("context")
              and row.get("context") in (4096, 16384)):
            impls.setdefault(impl, {})[f"prefill_{row['context'] // 1024}k_vs_sdpa"] = row.get("vs_sdpa")
    return {"copy_gbps": copy.get("gbps"), "impls": impls, "rows": rows}


def read_kernels_partial(rows: list[dict], outdir: Path) -> dict:
    return read_kernels(json.dumps({"measurements": rows}), outdir)


def read_gguf(stdout: str, outdir: Path) -> dict:
    """The step's matmuls in one graph (current, former and fastest tiles, bf16) and each layer's row."""
    r = _json_out(stdout, outdir)
    return {"step_us": r.get("step_us", {}), "bf16_over_current": r.get("bf16_over_current"),
            "former_over_current": r.get("former_over_current"), "bf16_over_best": r.get("bf16_over_best"),
            "copy_gbps": r.get("copy_gbps"), "layers": r.get("layers", [])}


def read_gguf_partial(rows: list[dict], outdir: Path) -> dict:
    step_us = {row["step"]: row["us"] for row in rows if "step" in row}
    return read_gguf(json.dumps({"step_us": step_us, "layers": [row for row in rows if "layer" in row]}), outdir)


def read_nothing(stdout: str, outdir: Path) -> dict:
    return {}


def _ms(seconds):
    return None if seconds is None else seconds * 1000


# -- the plan ------------------------------------------------------------------------------------------------
def _canned(figures: dict) -> list[str]:
    """A dry-run stand-in for a step: prints a result of the real step's shape."""
    return [sys.executable, "-c", f"import json; print(json.dumps({figures!r}))"]


_DRY_BATCH1 = {"systems": {"pagedchat": {"decode_tok_per_s": 1.0, "ttft_s": 0.1, "of_floor": 0.5},
                           "pagedchat, graphs off": {"decode_tok_per_s": 0.5, "ttft_s": 0.1, "of_floor": 0.25},
                           "pagedchat, not overlapped": {"decode_tok_per_s": 0.8, "ttft_s": 0.1, "of_floor": 0.4},
                           "pagedchat int4": {"decode_tok_per_s": 1.5, "ttft_s": 0.1, "of_floor": None},
                           "pagedchat gguf q4_k_m": {"decode_tok_per_s": 3.0, "ttft_s": 0.1, "of_floor": 0.6,
                                                     "weight_bytes": 2},
                           "transformers generate": {"error": "dry run"}},
               "floor": {"tok_per_s": 2.0, "copy_gbps": 1.0, "weight_bytes": 5}}
_DRY_THROUGHPUT = {"systems": {"pagedchat": {"output_tok_per_s": 2.0, "ttft_p50_s": 0.1},
                               "pagedchat-sync": {"output_tok_per_s": 1.5, "ttft_p50_s": 0.1},
                               "hf-generate": {"output_tok_per_s": 1.0, "ttft_p50_s": 0.2},
                               "hf-cb": {"error": "dry run"}},
                   "speedup": {"hf-generate": 2.0}, "greedy_agreement": {"hf-generate": {"identical": 1, "of": 1}}}
_DRY_SPEC = {"rows": [{"workload": w, "batch": b, "speedup": 2.0, "acceptance_rate": 0.5,
                      "greedy_identical": None if w == "regen" else True}
                     for b in (1, 8) for w in ("edit", "regen", "plain")]}
_DRY_GGUF = {"step_us": {"current": 100.0, "former": 150.0, "best": 90.0, "bf16": 300.0}, "bf16_over_current": 3.0,
             "former_over_current": 1.5, "bf16_over_best": 3.33, "copy_gbps": 1.0, "layers": []}
_DRY_KERNELS = {"measurements": [{"kernel": "device_copy", "gbps": 1.0},
                                 {"kernel": "decode", "sweep": "batch", "batch": 64, "impl": "v2", "copy_frac": 0.5,
                                  "vs_sdpa": 1.0},
                                 {"kernel": "prefill", "batch": 1, "context": 4096, "new_tokens": 4096, "impl": "v2",
                                  "vs_sdpa": 0.5}]}


def xdist_workers() -> list[str]:
    """pytest-xdist's workers where it is installed: the GPU tests spend most of their time compiling Triton
    kernels on the CPU, which eight processes do side by side (16 cores; the GPU has memory for all eight)."""
    import importlib.util

    return ["-n", "8"] if importlib.util.find_spec("xdist") else []


def plan(outdir: Path, model_dir: Path) -> list[Step]:
    """The steps in order of what the goals rest on; the limits come from the first run on an H100, with room."""
    py, cli = sys.executable, [sys.executable, "-m", "pagedchat.cli", "bench"]
    install = [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]
    tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS]
    return [
        Step("install", 45, install, read_nothing, dry_argv=install[:4] + ["--dry-run"] + install[4:]),
        Step("tests", 200, tests + xdist_workers() + [f"--junitxml={outdir / 'gpu-tests.xml'}"], read_tests,
             dry_argv=tests + ["--collect-only"], env={"PAGEDCHAT_TEST_OUTCOMES": str(outdir / OUTCOMES)},
             outputs=("gpu-tests.xml", OUTCOMES)),
        Step("model", 45, [py, "-m", "pagedchat.bench.gpu", "--build-model", str(model_dir)], read_nothing,
             dry_argv=_canned({})),
        Step("batch1", 170, cli + ["batch1", "-m", str(model_dir), "--device", "cuda", "--json"], read_batch1,
             dry_argv=_canned(_DRY_BATCH1), read_partial=read_batch1_partial, env={PARTIAL_ENV: "1"}),
        Step("throughput", 70, cli + ["throughput", "-m", str(model_dir), "--device", "cuda", *THROUGHPUT_ARGS,
                                      "--timeout", "40", "--json"], read_throughput,
             dry_argv=_canned(_DRY_THROUGHPUT)),
        # Both attention generations side by side in one run; FlexAttention's compile would take the step's time.
        Step("kernels", 90, cli + ["kernels", "--sweeps", "batch", "--no-flex", "--iters", "10", "--json"],
             read_kernels, dry_argv=_canned(_DRY_KERNELS), read_partial=read_kernels_partial, env={PARTIAL_ENV: "1"}),
        # The demo model: a trained model repeats what it read, a random one never does (ngram drafts nothing).
        # fp32: greedy tokens are compared, and bf16's rounding differs between a verify step's rows and decode's.
        Step("spec", 60, cli + ["spec", "-m", "demo", "--device", "cuda", "--dtype", "float32", "--batch", "8",
                                "--max-tokens", "96", "--repeats", "1", "--json"], read_spec,
             dry_argv=_canned(_DRY_SPEC)),
        Step("gguf", 75, cli + ["gguf", "--json"], read_gguf, dry_argv=_canned(_DRY_GGUF),
             read_partial=read_gguf_partial, env={PARTIAL_ENV: "1"}),
    ]


# -- running it ----------------------------------------------------------------------------------------------
def run_step(step: Step, limit: float, outdir: Path, dry_run: bool) -> dict:
    argv = step.dry_argv if dry_run else step.argv
    log = outdir / "logs" / f"{step.name.replace(' ', '-')}.log"
    for name in step.outputs:
        (outdir / name).unlink(missing_ok=True)
    start = time.monotonic()
    record = {"status": "ok", "limit_s": round(limit), "command": " ".join(argv)}
    try:
        proc = subprocess.run(argv, cwd=REPO, env={**os.environ, **step.env}, capture_output=True, text=True,
                              timeout=limit)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, code = _text(e.stdout), _text(e.stderr), None
        record.update(status="timeout", error=f"stopped after its limit of {limit:.0f} s")
    record["seconds"] = round(time.monotonic() - start, 1)
    log.write_text(f"$ {record['command']}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    if code not in (0, None):
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["(no output)"]
        record.update(status="failed", error=f"exit {code}: {tail[0]}")
    try:
        record["figures"] = step.read(stdout, outdir)
    except Exception as e:   # a failed or cut step may have printed nothing readable: its status says why
        if record["status"] == "ok":
            record.update(status="failed", error=f"unreadable output: {type(e).__name__}: {e}")
        rows = partial_rows(stderr)
        if rows and step.read_partial is not None:
            record["figures"] = {**step.read_partial(rows, outdir), "unfinished": True}
    return record


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def git_revision() -> str:
    """PAGEDCHAT_REVISION when the caller names it (a copied tree's .git can be older than the tree), else git's."""
    if os.environ.get("PAGEDCHAT_REVISION"):
        return os.environ["PAGEDCHAT_REVISION"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev, dirty = "", ""
    return (rev + ("+changes" if dirty else "")) if rev else "unknown"


def chosen(steps: list[Step], only: set[str] | None, model_dir: Path) -> list[Step]:
    """The steps `--only` names (a rerun of what failed), with the install and, when a step needs the model and it
    is not built yet, the model step."""
    if not only:
        return steps
    unknown = only - {s.name.split()[0] for s in steps}
    if unknown:
        raise SystemExit(f"gpu_check: unknown step(s) {', '.join(sorted(unknown))}; the steps are "
                         f"{', '.join(dict.fromkeys(s.name.split()[0] for s in steps))}")
    wanted = only | {"install"} | ({"model"} if only & {"batch1", "throughput", "spec"} and not model_dir.exists()
                                   else set())
    return [s for s in steps if s.name.split()[0] in wanted]


def run_check(outdir: Path, dry_run: bool = False, budget_s: float = BUDGET_S, only: set[str] | None = None,
              command: str = "scripts/gpu_check.sh") -> dict:
    from pagedchat.bench.common import machine_description, machine_info

    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "logs").mkdir(exist_ok=True)
    info = machine_info()
    report = {"check": "gpu", "dry_run": dry_run, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_revision": git_revision(), "machine": machine_description(info), "machine_info": info,
              "budget_s": budget_s, "command": command, "steps": {}}
    # The 2.5 GB model stays out of OUTDIR (which is copied back) and is reused by a rerun on the same machine.
    deadline, model_dir = time.monotonic() + budget_s, Path(tempfile.gettempdir()) / "pagedchat-gpu-check-llama-1b"
    for step in chosen(plan(outdir, model_dir), only, model_dir):
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            report["steps"][step.name] = {"status": "skipped", "error": f"{left:.0f} s of the budget left"}
        else:
            report["steps"][step.name] = run_step(step, min(step.limit_s, left), outdir, dry_run)
        write_report(report, outdir)
    report["wall_s"] = round(budget_s - max(0.0, deadline - time.monotonic()), 1)
    write_report(report, outdir)
    return report


def write_report(report: dict, outdir: Path) -> Path:
    path = outdir / "gpu-check.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    return path


def summary_rows(report: dict) -> list[list]:
    """One line per step: its status, seconds and headline figures."""
    rows = []
    for name, s in report["steps"].items():
        f = s.get("figures") or {}
        if name == "tests":
            words = (f"{f.get('passed', 0)} passed, {f.get('failed', 0)} failed, {f.get('skipped', 0)} skipped"
                     f"{' before the limit' if f.get('unfinished') else ''}"
                     if "passed" in f else f"{f.get('collected', 0)} collected")
        elif name == "batch1":
            words = (f"decode {_n(f.get('decode_tok_per_s'))} tok/s ({_pct(f.get('of_floor'))} of the "
                     f"{_n(f.get('floor_tok_per_s'))} floor), not overlapped "
                     f"{_n(f.get('decode_not_overlapped_tok_per_s'))}, "
                     f"graphs off {_n(f.get('decode_graphs_off_tok_per_s'))}, "
                     f"int4 {_n(f.get('int4_decode_tok_per_s'))} ({_n(f.get('int4_over_model_dtype'), 2)}x), "
                     f"GGUF Q4_K_M {_n(f.get('gguf_q4_k_m_decode_tok_per_s'))} "
                     f"({_n(f.get('gguf_q4_k_m_over_model_dtype'), 2)}x, {_pct(f.get('gguf_q4_k_m_of_floor'))} of its "
                     f"floor), "
                     f"transformers {_n(f.get('hf_decode_tok_per_s'))}; TTFT {_n(f.get('ttft_ms'), 1)} ms vs "
                     f"{_n(f.get('hf_ttft_ms'), 1)} ms")
        elif name == "throughput":
            words = ", ".join(f"{k} {_n(v)} tok/s" if v is not None else f"{k} failed"
                              for k, v in f.get("tok_per_s", {}).items())
            agree = [f"{k} {a['identical']}/{a['of']}" for k, a in f.get("greedy_agreement", {}).items()]
            words += f"; identical to pagedchat: {', '.join(agree)}" if agree else ""
        elif name == "spec":
            speedups = ", ".join(f"{w} {_n(x, 2)}x" for w, x in f.get("speedup_batch1", {}).items())
            words = (f"ngram at batch 1: {speedups} (plain not overlapped); greedy tokens identical: "
                     f"{f.get('greedy_identical')}" if f else "")
        elif name == "gguf":
            us = f.get("step_us", {})
            words = (f"one step's matmuls: Q4_K_M {_n(us.get('current'), 1)} µs (former tiles "
                     f"{_n(us.get('former'), 1)}, fastest per layer {_n(us.get('best'), 1)}), bf16 "
                     f"{_n(us.get('bf16'), 1)} µs = {_n(f.get('bf16_over_current'), 2)}x" if us else "")
        elif name == "kernels":
            words = "; ".join(
                f"{impl}: decode headline {_pct(k.get('decode_copy_frac'))} of copy, "
                f"{_n(k.get('decode_vs_sdpa'), 2)}x SDPA, prefill 4k {_n(k.get('prefill_4k_vs_sdpa'), 2)}x / "
                f"16k {_n(k.get('prefill_16k_vs_sdpa'), 2)}x SDPA" for impl, k in f.get("impls", {}).items())
            words += f" (copy {_n(f.get('copy_gbps'))} GB/s)" if f.get("copy_gbps") else ""
        else:
            words = ""
        if s.get("error"):
            words = f"{words}; {s['error']}" if words else s["error"]
        rows.append([name, s["status"], s.get("seconds"), words])
    return rows


def _n(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_summary(report: dict, path: Path) -> None:
    from pagedchat.bench.common import print_table

    print_table(f"GPU check{' (dry run)' if report['dry_run'] else ''}: {report['machine']}",
                ["step", "status", "s", "figures"], summary_rows(report),
                caption=f"git {report['git_revision']}, {report['date']}; full results: {path}")


def build_model(path: Path, device: str = "cuda", size: str = MODEL_SHAPE["size"]) -> None:
    """The benchmark model, initialized on the GPU (seconds instead of a minute of CPU init) and saved; kept from
    an earlier run on this machine. Renamed into place once whole, so a cut run leaves no half-written model."""
    import shutil

    import torch

    from pagedchat.bench.models import build_random_model

    if path.exists():
        return
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with torch.device(device):
        build_random_model(MODEL_SHAPE["arch"], partial, size, MODEL_SHAPE["max_positions"], dtype="bfloat16")
    partial.rename(path)


def gpu_missing() -> str | None:
    """One line saying why no GPU run can happen, or None. The first CUDA call of the run."""
    try:
        import torch
    except ImportError:
        return "gpu_check: torch is not installed"
    if not torch.cuda.is_available():
        return (f"gpu_check: no CUDA GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False); "
                f"--dry-run checks the plan without one")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", default=f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    parser.add_argument("--dry-run", action="store_true", help="the plan, the JSON and the table, on CPU")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--only", help="comma-separated steps to run (a rerun): tests, batch1, throughput, kernels, "
                                       "spec")
    parser.add_argument("--build-model", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_model:
        build_model(Path(args.build_model))
        return 0
    if not args.dry_run:
        missing = gpu_missing()
        if missing:
            print(missing, file=sys.stderr)
            return 2
    only = {name.strip() for name in args.only.split(",") if name.strip()} if args.only else None
    report = run_check(Path(args.outdir).resolve(), args.dry_run, args.budget, only,
                       " ".join(["scripts/gpu_check.sh", *(sys.argv[1:] if argv is None else argv)]))
    print_summary(report, Path(args.outdir) / "gpu-check.json")
    return 0 if all(s["status"] == "ok" for s in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
