"""`pagedchat bench gguf` (pagedchat/bench/gguf_kernels.py) off the GPU: the launches it times are those a Q4_K_M
file's model makes on CUDA, and its whole measurement runs (Triton interpreted, a stand-in timer) to a result."""

from __future__ import annotations

import pytest
import torch

from pagedchat import kernels as K
from pagedchat.bench import gguf_kernels as G

SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
TINY = dict(SMALL, vocab_size=256, intermediate_size=256, num_hidden_layers=1)   # Q4_K and Q6_K, interpreted


def test_the_1b_step_is_73_launches_of_0_80_gb():
    """16 layers: q+k(+v) joined (v is Q6_K in half the layers), o, gate+up joined, down; then the Q6_K head."""
    step = G.step_layers()
    assert len(step) == 17 and sum(map(len, step)) == 8 * 5 + 8 * 4 + 1
    assert sum(la.weight_bytes for launches in step for la in launches) == 799_592_448
    assert sum(la.per_step for la in G.distinct_layers(step)) == 73


def test_the_launches_are_those_of_the_loaded_file(tmp_path):
    """The file bench/gguf_writer.py writes, loaded as a model, its fused layers' parts joined as the loader joins
    them on CUDA: the same rows, types and bytes per launch, in step order."""
    pytest.importorskip("gguf")
    from pagedchat.bench.gguf_writer import write_llama_q4_k_m
    from pagedchat.model.gguf.linear import runs_of_one_type
    from pagedchat.model.gguf.load import load_gguf
    from pagedchat.model.gguf.reader import GGMLType

    path = write_llama_q4_k_m(tmp_path / "small.gguf", SMALL)
    model = load_gguf([path], torch.device("cpu"), "float32", None, False, None, None).model

    def launches(linear) -> list[tuple[int, int, str]]:
        return [(raw.shape[0], raw.shape[1], GGMLType(qtype).name) for raw, qtype in runs_of_one_type(linear.parts)]

    loaded = [launches(m) for layer in model.layers
              for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    loaded.append(launches(model.lm_head))
    benched = [[(la.out_features, la.weight_bytes // la.out_features, la.qtype)] for la in G.step_layers(SMALL)[-1]]
    per_layer = [[(la.out_features, la.weight_bytes // la.out_features, la.qtype) for la in launches]
                 for launches in G.step_layers(SMALL)[:-1]]
    ours = [launch for layer in per_layer for launch in _by_module(layer)] + benched
    assert ours == loaded
    assert {qtype for layer in per_layer for _, _, qtype in layer} == {"Q4_K", "Q6_K"}


def _by_module(layer: list[tuple]) -> list[list[tuple]]:
    """A decoder layer's launches grouped by module: q/k/v is one launch or two (v of another type)."""
    qkv = len(layer) - 3
    return [layer[:qkv], [layer[qkv]], [layer[qkv + 1]], [layer[qkv + 2]]]


@pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # random bytes: NaN scales, never read
def test_the_measurement_runs_to_a_result_under_the_interpreter(monkeypatch):
    """Every distinct layer's tiles and the step's four graphs are run (each timed callable is called); the
    fastest tile and the ratios come from the timer's figures."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 2e-6 if len(calls) % 3 else 1e-6

    step = G.step_layers(TINY)
    assert {la.qtype for launches in step for la in launches} == {"Q4_K", "Q6_K"}
    r = G.measure(timer, 100.0, step, torch.device("cpu"), candidates=False)
    kinds = G.distinct_layers(step)
    assert [(x["layer"], x["out"], x["in"], x["qtype"]) for x in r["layers"]] == [k.kind for k in kinds]
    for row in r["layers"]:
        assert set(row["us"]) <= {"current", "former"} and row["fastest"] in row["us"]
        assert row["us"][row["fastest"]] == min(row["us"].values())
    assert set(r["step_us"]) == {"current", "former", "best", "bf16"}
    assert r["bf16_over_current"] == r["step_us"]["bf16"] / r["step_us"]["current"]
    assert r["weight_bytes"] == sum(la.weight_bytes for launches in step for la in launches)
