"""Smoke tests of the batch-1 rows of `bench throughput` (decode, 512-token prefill, start-up, the optional
llama.cpp peer). No timing is asserted: the rows must exist, be positive, and say when the peer is skipped."""

from __future__ import annotations

import pytest

from pagedchat.bench import batch1
from pagedchat.bench.models import build_random_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_random_model("llama", tmp_path_factory.mktemp("b1") / "llama", "tiny", max_positions=1024)


def test_decode_and_prefill_rows_and_the_skipped_peer(tiny_llama, monkeypatch):
    monkeypatch.setattr(batch1, "llama_cpp_available", lambda: False)
    r = batch1.run_batch1_bench(tiny_llama, threads=1, repeats=1, new_tokens=4, decode_prompt=8, peer="llama.cpp")
    assert set(r["systems"]) == {"pagedchat", "transformers"}
    for m in r["systems"].values():
        assert m["decode_tok_per_s"] > 0 and m["prefill_s"] > 0 and m["decode16_tok_per_s"] > 0
    assert r["pagedchat_ratio"]["pagedchat"] == {"decode": 1.0, "prefill": 1.0, "decode16": 1.0}
    assert len(r["notes"]) == 1 and "llama.cpp peer skipped" in r["notes"][0]


def test_startup_is_timed_to_the_first_byte():
    s = batch1.startup_times(threads=1, repeats=1)
    assert set(s["median_s"]) == {"import torch", "pagedchat run"} and s["ratio"] > 0


def test_gguf_for_the_peer(tiny_llama, tmp_path):
    gguf = pytest.importorskip("gguf")
    for kind in batch1.LLAMA_CPP_TYPES:
        reader = gguf.GGUFReader(str(batch1.write_gguf(tiny_llama, tmp_path / f"{kind}.gguf", kind)))
        names = {t.name for t in reader.tensors}
        assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= names and len(names) == 2 * 9 + 3


def test_the_llama_cpp_peer_runs_when_installed(tiny_llama):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    r = batch1.run_batch1_bench(tiny_llama, threads=1, repeats=1, new_tokens=4, decode_prompt=8, peer="llama.cpp")
    assert {f"llama.cpp {kind}" for kind in batch1.LLAMA_CPP_TYPES} <= set(r["systems"]) and not r["notes"]
    for kind in batch1.LLAMA_CPP_TYPES:
        m = r["systems"][f"llama.cpp {kind}"]
        assert m["decode_tok_per_s"] > 0 and m["prefill_s"] > 0 and m["decode16_tok_per_s"] > 0


def test_the_gpu_rows_run_on_any_device(tmp_path):
    """The GPU batch-1 rows' code path (graphs on and off, TTFT, the floor, the Q4_K_M GGUF file of the model's
    shape: widths of whole 256-value blocks) on CPU: rows, no floor; the GPU check reads them."""
    import json

    from pagedchat.bench import gpu

    model = build_random_model("llama", tmp_path / "llama", "tiny", max_positions=1024, hidden_size=256,
                               intermediate_size=512)
    r = batch1.run_batch1_gpu(model, device="cpu", dtype="float32", decode_prompt=8, new_tokens=4,
                              ttft_tokens=32, ttft_runs=1)
    figures = gpu.read_batch1(json.dumps(r, indent=2), tmp_path)
    assert figures["decode_tok_per_s"] == r["systems"]["pagedchat"]["decode_tok_per_s"] and not figures["errors"]
    assert set(r["systems"]) == {"pagedchat", "pagedchat, graphs off", "pagedchat, not overlapped", "pagedchat int4",
                                 "pagedchat gguf q4_k_m", "transformers generate"}
    for m in r["systems"].values():
        assert m["decode_tok_per_s"] > 0 and m["ttft_s"] > 0 and m["of_floor"] is None
    assert r["floor"] is None and r["pagedchat_ratio"]["pagedchat"] == {"decode": 1.0, "ttft": 1.0}
    assert figures["int4_decode_tok_per_s"] == r["systems"]["pagedchat int4"]["decode_tok_per_s"]
    assert figures["int4_over_model_dtype"] > 0 and figures["overlap_speedup"] > 0
    assert figures["gguf_q4_k_m_over_model_dtype"] > 0
    # its blocks: (Q4_K's 4.5 or Q6_K's 6.5625 bits a weight) under a third of the fp32 model's weight bytes
    assert 0 < figures["gguf_q4_k_m_weight_bytes"] < r["systems"]["pagedchat"]["weight_bytes"] / 3


def test_the_q4_k_m_file_has_llama_cpps_types(tmp_path):
    from pagedchat.bench.gguf_writer import q4_k_m_type, write_llama_q4_k_m
    from pagedchat.model.gguf.reader import open_gguf

    assert [i for i in range(16) if q4_k_m_type("ffn_down", i, 16) == "Q6_K"] == [0, 1, 4, 7, 10, 13, 14, 15]
    shape = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    f = open_gguf([write_llama_q4_k_m(tmp_path / "m.gguf", shape, tied=False)])
    types = {name: t.qtype for name, t in f.tensors.items()}
    assert types["output.weight"] == 14 and types["token_embd.weight"] == 12 and types["blk.0.attn_norm.weight"] == 0
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == 14 and types["blk.1.attn_q.weight"] == 12
    assert f.tensors["blk.0.ffn_down.weight"].shape == (256, 512)
