"""GGUF files of every family answer exactly: a random HF model written as llama.cpp's converter writes it,
loaded by pagedchat, gives transformers' greedy tokens (a mismatch only at a checked near-tie) alone, batched
and as n variants.

The oracle is transformers running the HF model with the weights the file gives back (gguf-py's
dequantization of what was stored, the converter's transforms undone). transformers' own GGUF loading must give
the same tokens too, for every family it maps: it has no mapping for Mixtral (a `llama` file with experts).
"""

from __future__ import annotations

import random

import pytest
import torch

from gguf_models import build_hf, reference_model, write_gguf
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3")
TRANSFORMERS_READS_FAITHFULLY = ("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3")
# Every block format pagedchat reads, on a model whose rows are whole 256-value super-blocks.
QTYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
WIDE = dict(hidden_size=256, intermediate_size=512)
TOKENS = 24
# Every reply runs its full length on both sides: end-of-generation ids are the tokenizer tests' business.
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def _prompts(n, seed, lo=20, hi=45):
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


PROMPTS = _prompts(2, seed=7)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """(arch, qtype) -> (GGUF path, oracle HF model), built once per module."""
    made = {}

    def get(arch: str, qtype: str = "F32"):
        if (arch, qtype) not in made:
            root = tmp_path_factory.mktemp(f"{arch}-{qtype}")
            hf = build_hf(arch, root, **(WIDE if qtype != "F32" else {}))
            path = root / f"model-{qtype}.gguf"
            made[arch, qtype] = (path, reference_model(hf, write_gguf(hf, root, path, arch, qtype)))
        return made[arch, qtype]

    return get


def engine(path, quantize="none", **kw):
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", quantize=quantize,
                               num_blocks=128, **kw), show_progress=False)


def check_alone_batched_and_variants(eng, oracle):
    refs = [reference(oracle, p, TOKENS) for p in PROMPTS]
    outs = eng.generate([PROMPTS[0]], GREEDY)
    assert_greedy_equal(outs[0].outputs[0].token_ids, *refs[0])
    for out, ref in zip(eng.generate(PROMPTS, GREEDY), refs):
        assert_greedy_equal(out.outputs[0].token_ids, *ref)
    variants = eng.generate([PROMPTS[1]], GREEDY.with_(n=2))[0].outputs
    assert len(variants) == 2
    for v in variants:
        assert_greedy_equal(v.token_ids, *refs[1])
    eng.check_invariants()


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_in_f32_equals_transformers(gguf_model, arch):
    path, oracle = gguf_model(arch)
    check_alone_batched_and_variants(engine(path), oracle)


@pytest.mark.parametrize("arch", TRANSFORMERS_READS_FAITHFULLY)
def test_transformers_gguf_loading_agrees_where_it_reads_the_family(gguf_model, arch):
    from transformers import AutoModelForCausalLM

    path, oracle = gguf_model(arch)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    ours = engine(path).generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    assert_greedy_equal(ours, *reference(theirs, PROMPTS[0], TOKENS))


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_block_format_dequantized_equals_transformers(gguf_model, qtype):
    path, oracle = gguf_model("llama", qtype)
    check_alone_batched_and_variants(engine(path), oracle)


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_K", "Q6_K"))
def test_weights_kept_in_the_file_format_give_the_same_tokens(gguf_model, qtype):
    """The default: linear weights stay as the file's blocks, dequantized one layer at a time on the torch path
    (the native step multiplies them with 8-bit activations: tests/test_native_gguf.py checks it against its
    own twin)."""
    from pagedchat.model.gguf.linear import GGUFLinear

    path, oracle = gguf_model("qwen2", qtype)   # tied embeddings: the LM head reads the embedding's blocks
    eng = engine(path, quantize=None)
    eng.runner.native = eng.runner._native_next_try = None   # the torch path only (the library is process-wide)
    assert isinstance(eng.loaded.model.lm_head, GGUFLinear)
    assert any(isinstance(m, GGUFLinear) for m in eng.loaded.model.modules())
    check_alone_batched_and_variants(eng, oracle)



@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_K", "Q6_K"))
def test_weights_kept_in_the_file_format_on_the_gpu(gguf_model, qtype):
    """CUDA, fp32: the Triton GGUF matmuls inside decode steps captured in CUDA graphs give transformers' tokens;
    the parts of one type in a fused layer were joined at load (here q/k/v and gate/up: one launch each)."""
    from pagedchat.model.gguf.linear import GGUFLinear

    path, oracle = gguf_model("qwen2", qtype)
    eng = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=128), show_progress=False)
    assert eng.runner.graphs is not None
    layer = eng.loaded.model.layers[0]
    for fused in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert isinstance(fused, GGUFLinear) and len(fused.qtypes) == 1, fused
    check_alone_batched_and_variants(eng, oracle)

def test_a_model_no_kernel_runs_as_stored_is_dequantized_at_load_with_a_note(gguf_model, caplog):
    """The MoE families have no CPU kernel for the block formats yet: dequantizing every weight at every step
    would be far slower than dequantizing once, so they load dequantized and say so."""
    from pagedchat.model.gguf.linear import GGUFLinear

    path, oracle = gguf_model("qwen3_moe", "Q8_0")
    with caplog.at_level("WARNING", logger="pagedchat.engine"):
        eng = engine(path, quantize=None)
    assert not any(isinstance(m, GGUFLinear) for m in eng.loaded.model.modules())
    assert "dequantized to float32 at load" in caplog.text
    check_alone_batched_and_variants(eng, oracle)


def test_a_dequantized_tied_head_is_the_embedding_table(gguf_model):
    """A tied LM head dequantized at load is the embedding table itself, not a second copy of it."""
    path, oracle = gguf_model("gemma3", "Q8_0")
    model = engine(path).loaded.model      # --quantize none: every weight dequantized
    assert model.lm_head.weight is model.embed_tokens.weight


def test_gemma3_keeps_its_blocks_for_the_native_step(gguf_model, caplog):
    """Gemma 3's forward is in the native CPU step: its blocks stay as stored, nothing is dequantized at load
    (tests/test_native_gguf.py holds its steps to their twin)."""
    from pagedchat.model.gguf.linear import GGUFLinear
    from pagedchat.native import build

    if build.load(wait=True) is None:
        pytest.skip("no native build here (no C compiler?)")
    path, _ = gguf_model("gemma3", "Q8_0")
    with caplog.at_level("WARNING", logger="pagedchat.engine"):
        eng = engine(path, quantize=None)
    assert eng.runner.native is not None and "dequantized" not in caplog.text
    assert isinstance(eng.loaded.model.lm_head, GGUFLinear)   # the embedding's blocks, as the file has them


def test_the_torch_path_dequantizes_with_the_native_library(gguf_model, monkeypatch):
    """Once the library is loaded, steps on the torch path dequantize GGUF layers with it (bit for bit the torch
    functions' weights: tests/test_gguf_quants.py), and the tokens stay the oracle's."""
    from pagedchat.model.gguf import quants
    from pagedchat.native import build

    if build.load(wait=True) is None:
        pytest.skip("no native build here (no C compiler?)")
    monkeypatch.setattr(quants, "_fast", None)
    path, oracle = gguf_model("gemma3", "Q8_0")
    eng = engine(path, quantize=None)
    assert quants._fast is not None
    eng.runner.native = eng.runner._native_next_try = None   # every step on the torch path
    calls = []
    fast = quants._fast
    monkeypatch.setattr(quants, "_fast", lambda *a: calls.append(a[1]) or fast(*a))
    check_alone_batched_and_variants(eng, oracle)
    assert calls
