"""`bench throughput`'s accounting without timing: greedy agreement compares what it says, and a peer that fails
becomes a row with its error while the others are still measured."""

from __future__ import annotations

import pytest

from pagedchat.bench import throughput
from pagedchat.errors import UserError


def test_agreement_counts_over_the_tokens_both_produced():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6], [9, 9, 8, 7]]   # the second stopped at EOS; the third parts at token 2
    gaps = [[5.0] * 4, [5.0] * 2, [4.0, 3.0, 0.01, 2.0]]
    a = throughput.agreement(ours, theirs, gaps)
    assert (a["identical"], a["of"]) == (2, 3)
    assert (a["agreeing_tokens"], a["compared_tokens"]) == (4 + 2 + 2, 4 + 2 + 4)
    assert a["first_divergence_min"] == 2 and a["divergence_top2_gap_max"] == 0.01
    assert throughput.agreement(ours, ours)["identical"] == 3


def test_a_failing_peer_is_a_row_with_its_error(monkeypatch, capsys):
    def fake_worker(system, spec_path, workdir, timeout):
        if system == "hf-cb":
            raise UserError("hf-cb run failed: TypeError: ContinuousBatchingConfig.__init__() got an unexpected "
                            "keyword argument 'page_size'")
        return {"wall_s": 1.0, "ttft_s": [0.1, 0.2], "outputs": [[1, 2], [3, 4]], "peak_memory_bytes": 2**20}

    monkeypatch.setattr(throughput, "_run_worker", fake_worker)
    runs, errors = throughput._run_all(throughput.SYSTEMS, {}, repeats=2, timeout=1)
    assert set(runs) == {"pagedchat", "pagedchat-sync", "hf-generate"} and len(runs["hf-generate"]) == 2
    assert "page_size" in errors["hf-cb"]


def test_pagedchat_failing_fails_the_run(monkeypatch):
    def fake_worker(system, spec_path, workdir, timeout):
        raise UserError(f"{system} run failed: boom")

    monkeypatch.setattr(throughput, "_run_worker", fake_worker)
    with pytest.raises(UserError, match="pagedchat run failed"):
        throughput._run_all(throughput.SYSTEMS, {}, repeats=1, timeout=1)


def test_the_report_prints_the_failed_row_and_the_machine(capsys):
    r = {"model": "m", "device": "cpu", "requests": 2, "max_tokens": 2, "prompt_tokens": [3, 5], "machine": "M-LINE",
         "systems": {"pagedchat": {"output_tok_per_s": 10.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
                                   "peak_memory_mib": 1.0},
                     "hf-cb": {"error": "hf-cb run failed: no continuous batching"}},
         "speedup": {}, "greedy_agreement": {}}
    throughput.print_throughput_report(r)
    out = capsys.readouterr().out
    assert "no continuous batching" in out and "M-LINE" in out
