"""oneDNN-packed fp32 linear layers on CPU (pagedchat/model/packed.py): which layers get a packed copy, that one
row still takes the plain weight (bit for bit), that more rows give the same product up to float rounding,
and that a model whose layers are packed still decodes transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedchat.model import packed
from hf_models import build_model
from oracle import assert_greedy_equal, reference

pytestmark = pytest.mark.skipif(not packed.can_pack(torch.device("cpu"), torch.float32),
                                reason="this torch has no oneDNN linear")


def test_a_few_rows_take_the_plain_matmul_and_more_rows_the_same_product():
    torch.manual_seed(0)
    linear = nn.Linear(512, 768, bias=True)
    layer = packed.PackedLinear(linear)
    assert layer.weight is linear.weight  # shared, not copied: the packed layout is the only extra copy
    for rows in range(1, packed.PACKED_MIN_ROWS):
        few = torch.randn(rows, 512)
        assert torch.equal(layer(few), nn.functional.linear(few, linear.weight, linear.bias))
    for rows in (packed.PACKED_MIN_ROWS, 7, 64):
        x = torch.randn(3, rows, 512)  # leading dimensions are kept
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


def test_what_gets_packed():
    model = nn.ModuleDict({"big": nn.Linear(512, 512, bias=False), "small": nn.Linear(64, 64),
                           "embed": nn.Embedding(1024, 512), "tied": nn.Linear(512, 1024, bias=False)})
    model["tied"].weight = model["embed"].weight  # a tied LM head shares the embedding's table: stays plain
    assert packed.pack_linears(model) == 1
    assert isinstance(model["big"], packed.PackedLinear)
    assert type(model["small"]) is nn.Linear and type(model["tied"]) is nn.Linear


def test_no_packed_copies_when_they_would_crowd_the_ram(monkeypatch):
    model = nn.Sequential(nn.Linear(512, 512))
    monkeypatch.setattr(packed, "available_ram", lambda: 4 * 512 * 512)  # the copy would take all of it
    assert packed.pack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_model_decodes_transformers_greedy_tokens(tmp_path, arch):
    """Layers large enough to be packed (hidden 512): prefill and batched decode take the packed copies."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    hf = build_model(arch, tmp_path / arch, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                     num_key_value_heads=4, initializer_range=0.05)
    engine = Engine(EngineConfig(model=str(tmp_path / arch), device="cpu", num_blocks=64), show_progress=False)
    assert any(isinstance(m, packed.PackedLinear) for m in engine.runner.model.modules())
    prompts = [[5, 17, 99, 3, 250, 41, 8], [7, 7, 12, 200, 31]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logits = reference(hf, prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, ref_tokens, ref_logits)
