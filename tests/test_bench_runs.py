"""Smoke tests of `bench throughput` and `bench chat` on a tiny random model with tiny sizes. No timing is
asserted; what must hold is the accounting (token counts, KV reuse, copies per fork) and greedy agreement."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pagedchat.cli import app


def bench(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", *args, "--json"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads(result.stdout)


def test_throughput_smoke_all_systems_agree():
    r = bench("throughput", "--random", "llama", "--random-size", "tiny", "--requests", "3", "--max-tokens", "5",
              "--mean-prompt", "20", "--max-prompt", "40", "--device", "cpu", "--profile", "--no-batch1")
    assert set(r["systems"]) == {"pagedchat", "hf-generate", "hf-cb"}
    for name, m in r["systems"].items():
        assert m["output_tokens"] == 3 * 5 and m["all_max_tokens"], name   # EOS ignored everywhere
        assert m["output_tok_per_s"] > 0 and m["ttft_p50_s"] > 0 and m["ttft_p99_s"] >= m["ttft_p50_s"]
        assert m["peak_memory_mib"] >= 0
    for name in ("hf-generate", "hf-cb"):
        assert r["greedy_agreement"][name]["identical"] == 3, (name, r["greedy_agreement"])
        assert r["speedup"][name] > 0
    assert len(r["prompt_tokens"]) == 3 and max(r["prompt_tokens"]) <= 40
    shares = r["pagedchat_profile"]["shares"]
    assert abs(sum(shares.values()) - 1) < 1e-6


def test_chat_smoke_reuses_history_and_forks_with_one_copy_per_child():
    r = bench("chat", "--random", "llama", "--random-size", "tiny", "--history", "64,200", "--message-tokens", "8",
              "--reply-tokens", "4", "--variants", "3", "--repeats", "1", "--device", "cpu",
              "--beams", "4", "--beam-prompts", "90", "--beam-tokens", "10")
    assert [t["history"] for t in r["turns"]] == [64, 200]
    for t in r["turns"]:
        # The pinned history's KV is reused up to its last token (whose KV was never computed: it was sampled).
        assert t["prefix_hit_tokens"] == t["history"] - 1
        assert t["prefilled_tokens"] == 8 + 1
        assert t["compute_ratio"] > 1 and t["hf_reprefill_ttft_s"] > 0
    assert r["turns"][1]["compute_ratio"] > r["turns"][0]["compute_ratio"]
    for f in r["forks"]:
        assert f["copies_per_child"] == 1                 # the prompt ends mid-block: one copy per child
        assert f["cow_copies_one"] <= 1                   # continuing the pin copies at most its partial block
        assert f["extra_blocks_n"] == f["extra_blocks_one"] + (3 - 1)   # one private tail block per extra child
        assert f["hf_kv_tokens_n"] == 3 * (f["history"] + f["message_tokens"] + 1)
    assert r["max_copies_per_child"] == 1
    # beam search on the real model: the prompt held once, at most W copies a step, transformers' own cache
    # holds W whole histories
    beams = r["beams"]
    assert beams["width"] == 4 and len(beams["runs"]) == 1
    run = beams["runs"][0]
    assert run["one_sequence_peak_blocks"] == -(-(90 + 10) // 16)
    assert run["one_sequence_peak_blocks"] < run["peak_blocks"] < run["contiguous_peak_blocks"]
    assert run["max_copies_per_step"] <= 4 and len(run["blocks_over_time"]) == 10 - 1
    assert run["hf_beam_kv_tokens"] == 4 * (90 + 10 - 1)


def test_model_choice_errors_are_user_errors():
    from pagedchat.errors import UserError

    runner = CliRunner()
    for args in (["bench", "throughput"], ["bench", "chat", "-m", "x", "--random", "llama"],
                 ["bench", "chat", "--random", "gpt2"], ["bench", "throughput", "--random", "llama", "--plot", "x.jpg"],
                 ["bench", "chat", "--random", "llama", "--history", "a,b"]):
        result = runner.invoke(app, args)
        assert isinstance(result.exception, UserError), (args, result.exception)


def test_bench_kernels_without_cuda_is_a_clear_error(monkeypatch):
    import sys
    import types

    import torch

    from pagedchat.errors import UserError

    fake = types.ModuleType("pagedchat.bench.kernels")

    def run_kernel_bench(show=True, plot_path=None):
        raise RuntimeError("the kernel benchmark needs CUDA")

    fake.run_kernel_bench = run_kernel_bench
    monkeypatch.setitem(sys.modules, "pagedchat.bench.kernels", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "kernels"])
    assert isinstance(result.exception, UserError)
    assert "CUDA" in str(result.exception)


def test_step_smoke_splits_the_step_into_its_parts():
    r = bench("step", "--tokens", "3", "--repeats", "1")
    ms = r["ms_per_step"]
    assert set(ms) == {"step", "model forward", "compute_logits", "engine Python"} and r["model"] == "demo"
    assert ms["step"]["cpu"] > 0 and ms["model forward"]["cpu"] <= ms["step"]["cpu"]


def test_accuracy_smoke_int8_on_the_demo_model():
    r = bench("accuracy", "-m", "demo", "--prompts", "1", "--tokens", "4")
    row = r["rows"][0]
    assert r["quantize"] == "int8" and row["prompts"] == 1 and 0 <= row["greedy_agreement"] <= 1
    assert 0 <= row["max_logit_error_rel_spread"] < 0.05     # trained weights: int8 moves logits little
