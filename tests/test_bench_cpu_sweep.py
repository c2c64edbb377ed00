"""Smoke test of `pagedchat bench cpu-sweep`: every path and peer at each batch size, in its own process, and the
report. No timing is asserted: the rows must exist and be positive, the native step must have been used where
it was forced, and the report must name what it compared."""

from __future__ import annotations

from pagedchat.bench import cpu_sweep
from pagedchat.bench.models import build_random_model


def test_each_system_at_each_batch_size(tmp_path, monkeypatch, capsys):
    from pagedchat.bench import batch1

    monkeypatch.setattr(batch1, "llama_cpp_available", lambda: False)
    model = build_random_model("llama", tmp_path / "llama", "tiny", max_positions=1024)
    r = cpu_sweep.run_cpu_sweep(model, threads=1, batches=[1, 3], repeats=1, peer="llama.cpp")
    assert set(r["decode_tok_per_s"]) == {"pagedchat", "pagedchat native", "pagedchat torch", "transformers"}
    assert all(rate > 0 for rates in r["decode_tok_per_s"].values() for rate in rates.values())
    from pagedchat.native import build

    assert r["new_tokens"] == {"1": 256, "3": 86} and r["native_bound"] == (build.load() is not None)
    assert "llama.cpp peer skipped" in r["notes"][0]
    cpu_sweep.print_cpu_sweep_report(r)
    out = capsys.readouterr().out
    assert "native / torch" in out and "pagedchat / transformers" in out


def test_every_run_decodes_enough_tokens_to_time():
    assert [cpu_sweep.new_tokens(b) for b in (1, 2, 4, 8, 64)] == [256, 128, 64, 32, 32]


def test_skipped_rows_are_not_run_nor_reported(tmp_path, monkeypatch, capsys):
    model = build_random_model("llama", tmp_path / "llama", "tiny", max_positions=1024)
    ran = []

    def run(name, spec, workdir, timeout):  # the workers themselves are the test above's
        ran.append(name)
        return {"decode_tok_per_s": {"2": 10.0}, "native_bound": True, "paths": {}}

    monkeypatch.setattr(cpu_sweep, "_run", run)
    r = cpu_sweep.run_cpu_sweep(model, threads=1, batches=[2], repeats=2, skip=("torch", "transformers"))
    assert ran == ["pagedchat", "pagedchat native"] * 2 and set(r["decode_tok_per_s"]) == set(ran)
    cpu_sweep.print_cpu_sweep_report(r)
    out = capsys.readouterr().out
    assert "pagedchat native" in out and "native / torch" not in out and "transformers" not in out


def test_an_unknown_row_to_skip_is_one_line(pagedchat_cli):
    code, out, err = pagedchat_cli("bench", "cpu-sweep", "--random", "llama", "--random-size", "tiny",
                                   "--skip", "native,llama")
    assert code != 0 and "--skip takes native, torch, transformers; got llama" in err
    assert "Traceback" not in out + err
