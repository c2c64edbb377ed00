"""`scripts/gpu_check.sh` without a GPU: the dry run goes through the whole plan (each step's process, its time
limit, the JSON written after every step, the table), a missing GPU is one line and a non-zero exit, and the
GPU paths import nothing of the server's or the REPL's dependencies (the GPU machine does not have them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedchat.bench import gpu
from pagedchat.bench.common import PARTIAL_ENV

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
ABSENT_ON_THE_GPU_MACHINE = ("prompt_toolkit", "fastapi", "uvicorn", "llguidance", "starlette")
BLOCKER = f"""
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, Absent())
"""


@pytest.fixture
def gpu_machine_env(tmp_path):
    """Processes started with this environment cannot import what the GPU machine lacks."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_the_dry_run_goes_through_the_plan_and_writes_the_json_and_the_table(tmp_path, gpu_machine_env):
    out = tmp_path / "out"
    proc = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, env=gpu_machine_env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert list(report["steps"]) == ["install", "tests", "model", "batch1", "throughput", "kernels", "spec", "gguf"]
    assert all(s["status"] == "ok" for s in report["steps"].values()), report["steps"]
    assert report["steps"]["tests"]["figures"]["collected"] > 10          # the GPU tests import without a GPU
    assert report["steps"]["batch1"]["figures"]["of_floor"] == 0.5
    assert report["steps"]["batch1"]["figures"]["int4_over_model_dtype"] == 1.5
    assert report["steps"]["batch1"]["figures"]["gguf_q4_k_m_over_model_dtype"] == 3.0
    assert report["steps"]["batch1"]["figures"]["gguf_q4_k_m_of_floor"] == 0.6
    batch1_words = next(row[3] for row in gpu.summary_rows(report) if row[0] == "batch1")
    assert "GGUF Q4_K_M 3 (3.00x, 60% of its floor)" in batch1_words
    assert report["steps"]["batch1"]["figures"]["overlap_speedup"] == 1.25
    assert report["steps"]["spec"]["figures"]["speedup_batch1"]["edit"] == 2.0
    assert report["steps"]["spec"]["figures"]["greedy_identical"] is True
    assert report["steps"]["kernels"]["figures"]["impls"]["v2"] == {"decode_copy_frac": 0.5, "decode_vs_sdpa": 1.0,
                                                                    "prefill_4k_vs_sdpa": 0.5}
    assert report["steps"]["gguf"]["figures"]["bf16_over_current"] == 3.0
    assert "Q4_K_M 100.0 µs (former tiles 150.0, fastest per layer 90.0), bf16 300.0 µs = 3.00x" in \
        next(row[3] for row in gpu.summary_rows(report) if row[0] == "gguf")
    assert {"git_revision", "date", "machine_info", "budget_s", "wall_s", "command"} <= set(report)
    for name in ("torch", "triton", "transformers", "cpu_isa"):
        assert name in report["machine_info"]
    assert "GPU check (dry run)" in proc.stdout and "throughput" in proc.stdout
    assert (out / "logs" / "tests.log").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_no_gpu_is_one_line_and_a_non_zero_exit(tmp_path):
    proc = subprocess.run([str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_paths_import_nothing_the_gpu_machine_lacks(gpu_machine_env):
    code = ("import pagedchat.cli, pagedchat.engine, pagedchat.bench.throughput, pagedchat.bench.batch1, "
            "pagedchat.bench.kernels, pagedchat.bench.gpu, pagedchat.model.loader; "
            "from typer.testing import CliRunner; "
            "r = CliRunner().invoke(pagedchat.cli.app, ['bench', 'throughput', '--help']); assert r.exit_code == 0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=gpu_machine_env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_a_failing_or_overlong_step_is_recorded_and_the_run_goes_on(tmp_path):
    (tmp_path / "logs").mkdir()
    fails = gpu.Step("fails", 30, [sys.executable, "-c", "import sys; sys.exit('boom')"], gpu.read_nothing)
    hangs = gpu.Step("hangs", 30, [sys.executable, "-c", "import time; time.sleep(30)"], gpu.read_nothing)
    failed = gpu.run_step(fails, 30, tmp_path, dry_run=False)
    assert failed["status"] == "failed" and "boom" in failed["error"]
    cut = gpu.run_step(hangs, 1, tmp_path, dry_run=False)
    assert cut["status"] == "timeout" and cut["seconds"] < 10


def test_step_outputs_are_read_after_other_output(tmp_path):
    printed = 'a warning [W x]\n{\n  "systems": {"pagedchat": {"output_tok_per_s": 5.0, "ttft_p50_s": 0.5}, ' \
              '"hf-cb": {"error": "hf-cb run failed: X"}},\n  "speedup": {}, "greedy_agreement": {}\n}\n'
    figures = gpu.read_throughput(printed, tmp_path)
    assert figures["tok_per_s"] == {"pagedchat": 5.0, "hf-cb": None} and figures["errors"]["hf-cb"].endswith("X")
    (tmp_path / "gpu-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/><testcase classname="t" name="bad">'
        '<failure message="qwen2-mha7: new token 3: pagedchat 5 != transformers 7"/></testcase>'
        '<testcase classname="t" name="skip"><skipped/></testcase></testsuite></testsuites>')
    tests = gpu.read_tests("", tmp_path)
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert "pagedchat 5 != transformers 7" in tests["failures"][0]["message"]


def test_the_benchmark_model_is_built_whole_once(tmp_path):
    path = tmp_path / "model"
    gpu.build_model(path, device="cpu", size="tiny")
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"
    assert not path.with_name("model.partial").exists()
    stamp = (path / "config.json").stat().st_mtime_ns
    gpu.build_model(path, device="cpu", size="tiny")          # a rerun keeps it
    assert (path / "config.json").stat().st_mtime_ns == stamp


def test_a_tests_step_cut_at_its_limit_keeps_the_outcomes_streamed_so_far(tmp_path):
    """tests/conftest.py writes each outcome as it comes; the check reads them when pytest left no report."""
    outcomes = tmp_path / gpu.OUTCOMES
    env = {**os.environ, "PAGEDCHAT_TEST_OUTCOMES": str(outcomes)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_check.py",
                    "-k", "read_after_other_output or no_gpu_is_one_line"], cwd=gpu.REPO, env=env, check=True,
                   capture_output=True, timeout=120)
    with outcomes.open("a") as f:   # as a failure mid-run would add
        f.write(json.dumps({"test": "t::bad", "outcome": "failed", "message": "pagedchat 5 != transformers 7"}) + "\n")
        f.write(json.dumps({"test": "t::fixture", "outcome": "error", "message": "setup broke"}) + "\n")
    tests = gpu.read_tests("", tmp_path)
    assert (tests["passed"], tests["failed"], tests["skipped"], tests["unfinished"]) == (2, 2, 0, True)
    assert [f["message"] for f in tests["failures"]] == ["pagedchat 5 != transformers 7", "setup broke"]
    assert "2 passed, 2 failed, 0 skipped before the limit" in gpu.summary_rows(
        {"steps": {"tests": {"status": "timeout", "seconds": 170, "figures": tests}}})[0][3]


def test_a_benchmark_cut_at_its_limit_keeps_the_rows_it_finished(tmp_path):
    """batch1 and kernels print each finished row (bench.common.report_partial); a step stopped at its limit
    reads its figures from them."""
    (tmp_path / "logs").mkdir()
    rows = [{"system": "pagedchat", "decode_tok_per_s": 600.0, "ttft_s": 0.012, "of_floor": 0.6,
             "floor": {"tok_per_s": 1000.0, "copy_gbps": 3000.0, "weight_bytes": 3e9}},
            {"system": "pagedchat, graphs off", "decode_tok_per_s": 310.0, "ttft_s": 0.013, "of_floor": 0.31,
             "floor": {"tok_per_s": 1000.0, "copy_gbps": 3000.0, "weight_bytes": 3e9}}]
    script = ("import time\nfrom pagedchat.bench.common import report_partial\n"
              f"for row in {rows!r}:\n    report_partial(row)\ntime.sleep(60)\n")
    step = gpu.Step("batch1", 60, [sys.executable, "-c", script], gpu.read_batch1,
                    read_partial=gpu.read_batch1_partial, env={PARTIAL_ENV: "1"})
    quiet = subprocess.run([sys.executable, "-c", script.replace("time.sleep(60)", "")], capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != PARTIAL_ENV})
    assert quiet.stderr == ""    # a user's run prints no rows of its own
    record = gpu.run_step(step, 8, tmp_path, dry_run=False)
    assert record["status"] == "timeout"
    f = record["figures"]
    assert (f["decode_tok_per_s"], f["decode_graphs_off_tok_per_s"], f["ttft_ms"], f["floor_tok_per_s"],
            f["unfinished"]) == (600.0, 310.0, 12.0, 1000.0, True)
    assert f["int4_decode_tok_per_s"] is None

    kernel_rows = [{"kernel": "device_copy", "gbps": 3000.0},
                   {"kernel": "decode", "sweep": "batch", "batch": 64, "impl": "v2", "copy_frac": 0.8, "vs_sdpa": 1.1},
                   {"kernel": "prefill", "batch": 1, "context": 16384, "new_tokens": 16384, "impl": "v1",
                    "vs_sdpa": 0.4}]
    figures = gpu.read_kernels_partial(kernel_rows, tmp_path)
    assert figures["impls"] == {"v2": {"decode_copy_frac": 0.8, "decode_vs_sdpa": 1.1},
                                "v1": {"prefill_16k_vs_sdpa": 0.4}}

    gguf_rows = [{"layer": "o", "out": 2048, "in": 2048, "qtype": "Q4_K", "us": {"current": 4.0, "former": 6.0}},
                 {"step": "current", "us": 210.0}, {"step": "former", "us": 300.0}]
    figures = gpu.read_gguf_partial(gguf_rows, tmp_path)
    assert figures["step_us"] == {"current": 210.0, "former": 300.0} and figures["layers"] == gguf_rows[:1]
    assert figures["bf16_over_current"] is None
