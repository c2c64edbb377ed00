"""The families beyond Llama (issue 19): greedy tokens equal transformers' generate for 64 tokens alone,
batched, with chunked prefill, as forks and under preemption; their pieces (longrope tables, the MoE
kernels) against their own oracles; `models show` names the family (unsupported ones: test_bad_input)."""

import json
import random

import pytest
import torch

from hf_models import NEW_FAMILIES
from oracle import assert_greedy_equal, reference
from pagedchat import kernels as K
from pagedchat.engine import Engine, EngineConfig, SamplingParams

TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)


def prompts(n, seed, lo=3, hi=80):
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# The prompts every family is checked on (alone: the first; batched with chunked prefill: the first two;
# under preemption: all four), so each needs its transformers reference only once.
PROMPTS = prompts(4, seed=13, lo=20, hi=50)
# A block holds one layer slot per group member, and Gemma's window groups hold blocks of their own: the
# same token budget needs more blocks there. Each size still preempts with four 64-token replies.
SMALL_POOL = {"gemma3": 28}
_REFERENCES: dict = {}


def ref(model_dirs, arch, prompt, tokens=TOKENS):
    key = (arch, tuple(prompt), tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(model_dirs[arch][1], prompt, tokens)
    return _REFERENCES[key]


def engine_for(model_dirs, arch, **kw):
    return Engine(EngineConfig(model=str(model_dirs[arch][0]), **{"num_blocks": 256, **kw}), show_progress=False)


def check(engine, model_dirs, arch, batch):
    for prompt, out in zip(batch, engine.generate(batch, GREEDY)):
        assert_greedy_equal(out.outputs[0].token_ids, *ref(model_dirs, arch, prompt))
    engine.check_invariants()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_64_tokens_alone_batched_chunked_preempted(model_dirs, arch):
    check(engine_for(model_dirs, arch), model_dirs, arch, PROMPTS[:1])
    check(engine_for(model_dirs, arch, max_num_batched_tokens=9), model_dirs, arch, PROMPTS[:2])
    small = engine_for(model_dirs, arch, num_blocks=SMALL_POOL.get(arch, 20), block_size=8)
    check(small, model_dirs, arch, PROMPTS)
    assert small.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_64_tokens_through_a_fork(model_dirs, arch):
    engine, prompt = engine_for(model_dirs, arch), PROMPTS[0]
    parent = engine.generate([prompt], GREEDY.with_(max_tokens=5), keep=True)[0].outputs[0]
    child = engine.fork(parent.handle, GREEDY.with_(max_tokens=TOKENS - 5))
    while not engine.requests[child].finished:
        engine.step()
    tokens = parent.token_ids + engine.pop_output(child).outputs[0].token_ids
    assert_greedy_equal(tokens, *ref(model_dirs, arch, prompt))


def test_phi3_longrope_tables_switch_to_long_factors_past_the_original_context(model_dirs):
    from pagedchat.model.rope import TableRotary

    hf = model_dirs["phi3"][1]
    original = hf.config.rope_parameters["original_max_position_embeddings"]
    ours = TableRotary.from_config(hf.config, 16, 512)
    ours.positions.ensure(512)
    x = torch.zeros(1)
    for position in (0, 5, original - 1, original, 400):
        cos, sin = hf.model.rotary_emb(x, torch.tensor([[position]]))  # HF picks short/long by this length
        assert torch.allclose(ours.cos[position], cos[0, 0], atol=1e-6)
        assert torch.allclose(ours.sin[position], sin[0, 0], atol=1e-6)
    assert ours.rotary_dim == 12  # partial rotary: 0.75 of head_dim 16


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [(1, 8, 2, 64, 48), (37, 4, 2, 32, 16),
                                                                       (70, 8, 3, 48, 96), (5, 16, 1, 16, 16)])
def test_fused_moe_triton_matches_torch_twin(monkeypatch, num_tokens, num_experts, top_k, hidden, inter):
    if not K.HAS_TRITON:
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1).topk(top_k)
    ours = K.fused_moe(x, w13, w2, weights, ids, backend="triton")
    oracle = K.fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    torch.testing.assert_close(ours.double(), oracle, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [9, 1])  # 1: the batch-1 decode path
def test_grouped_moe_equals_per_token_loop(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    x, w13, w2 = torch.randn(num_tokens, 8, generator=g), torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g)
    weights, ids = torch.rand(num_tokens, 2, generator=g), torch.randint(0, 4, (num_tokens, 2), generator=g)
    expected = torch.stack([sum(weights[t, j] * (w2[e] @ K.moe_reference.silu_and_mul(w13[e] @ x[t]))
                                for j, e in enumerate(ids[t].tolist())) for t in range(num_tokens)])
    torch.testing.assert_close(K.fused_moe_ref(x, w13, w2, weights, ids), expected)


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_models_show_names_the_family(typer_cli, model_dirs, arch):
    shown = json.loads(typer_cli("models", "show", str(model_dirs[arch][0]), "--json").output)
    family = {s["key"]: s["value"] for s in shown["settings"]}["family"]
    assert family.startswith(f"{arch}: ")


def test_gemma_releases_window_blocks_and_follow_ups_stay_exact(model_dirs):
    """Window groups give blocks back as a chat grows; a follow-up turn from the pinned branch and a
    branch from an earlier point (whose window blocks the branch has released: found again in the prefix
    cache) both reuse KV and match transformers."""
    engine, hf = engine_for(model_dirs, "gemma3", block_size=8), model_dirs["gemma3"][1]
    window = hf.config.sliding_window
    groups = engine.runner.kv_groups
    assert groups.num_window_groups == 2 and groups.num_slots == 2   # 2 global, 4 window layers
    prompt = prompts(1, seed=16, lo=40, hi=40)[0]
    first = engine.generate([prompt], GREEDY.with_(max_tokens=20), keep=True)[0].outputs[0]
    head = first.handle.sequence   # white-box: the engine's sequence behind the branch handle
    dead = (head.num_computed - window + 1) // 8
    assert dead > 0 and all(t[:dead] == [-1] * dead for t in head.window_tables)
    assert engine.pool.num_used == len(head.block_table) + 2 * (len(head.block_table) - dead)
    for follow_up, reused in ((first.token_ids_all + [7, 8, 9], head.num_computed), (prompt[:30] + [11, 12], 24)):
        rid = engine.add_request(follow_up, GREEDY.with_(max_tokens=24), parent=head)
        while not engine.requests[rid].finished:
            engine.step()
        out = engine.pop_output(rid)
        assert out.prefix_hit_tokens == reused
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, follow_up, 24))
    engine.check_invariants()


def test_gemma_prefix_cache_hits_window_blocks_released_but_still_cached(model_dirs):
    """A prompt sharing 50 tokens with a finished one hits the cache for 48 (six blocks): the global blocks,
    and in each window group the blocks of the window before the hit, released by then but still cached."""
    engine, hf = engine_for(model_dirs, "gemma3", block_size=8), model_dirs["gemma3"][1]
    first = prompts(1, seed=17, lo=60, hi=60)[0]
    engine.generate([first], GREEDY.with_(max_tokens=4))
    second = first[:50] + [5, 6, 7]
    out = engine.generate([second], GREEDY.with_(max_tokens=24))[0]
    assert out.prefix_hit_tokens == 48
    assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, second, 24))
    engine.check_invariants()


def test_gemma3_vision_language_checkpoint_serves_its_text_model(tmp_path, typer_cli):
    """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: its text model is loaded (image tower
    skipped) and its greedy tokens equal transformers' generate on text input."""
    from hf_models import build_gemma3_vision_language

    hf = build_gemma3_vision_language(tmp_path / "gemma3_vl")
    engine = Engine(EngineConfig(model=str(tmp_path / "gemma3_vl"), num_blocks=256), show_progress=False)
    prompt = PROMPTS[0]
    out = engine.generate([prompt], GREEDY.with_(max_tokens=24))[0]
    assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 24))
    shown = json.loads(typer_cli("models", "show", str(tmp_path / "gemma3_vl"), "--json").output)
    assert {s["key"]: s["value"] for s in shown["settings"]}["family"].startswith("gemma3: ")


@pytest.mark.parametrize("longrope", [False, True])
def test_rope_tables_are_computed_as_far_as_positions_go_and_equal_whole_tables(longrope, model_dirs):
    """A model's rope tables hold rows only for the positions asked for so far (a 32k-position Gemma 3 table
    would take 134 MB), in pages of memory written only then; every row equals the whole table's row."""
    from pagedchat.model.layers import RotaryEmbedding
    from pagedchat.model.rope import TableRotary

    config = model_dirs["phi3" if longrope else "llama"][1].config
    size, chunk = 5000, 1024
    rotary = TableRotary.from_config(config, 16, size) if longrope else RotaryEmbedding(config, 16, size)
    assert rotary.positions.filled == 0
    rotary.rotate(torch.tensor([3, 1500]), torch.ones(2, 1, 16))
    assert rotary.positions.filled == 2 * chunk
    rotary.rotate(torch.tensor([size - 1]), torch.ones(1, 1, 16))
    assert rotary.positions.filled == size
    whole = rotary.positions.compute(torch.arange(size))   # every row at once, as the tables once were made
    for got, want in zip(rotary.positions.tables, whole):
        assert torch.equal(got, want)
