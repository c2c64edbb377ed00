"""The whole engine on the Triton kernels, run by the Triton interpreter on CPU, against transformers: every
supported family and the shapes that stress the kernels (MHA, odd head counts, head dims 32/40/48/80), through
every way a step is scheduled: a batch of mixed lengths over many blocks, chunked prefill, a prefix-cache hit,
n > 1, a fork, and decode through the CUDA-graph static buffers (tests/graph_double.py).

This is what a GPU runs, minus the hardware: the kernels' indexing, masking and split logic and the runner's
graph padding are all exercised; only compiled numerics differ."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from graph_double import capture_on_cpu
from hf_models import ARCHS, NEW_FAMILIES, build_model
from oracle import assert_greedy_equal, reference
from pagedchat import kernels as K
from pagedchat.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="triton not installed")

# Shapes beyond the family defaults (tests/hf_models.py): name -> (family, config overrides).
SHAPES = {
    # the shape that diverged on an H200: MHA (group 1), 7 heads, head dim 32, qkv bias, tied embeddings
    "qwen2-mha7-d32": ("qwen2", dict(num_attention_heads=7, num_key_value_heads=7, hidden_size=224)),
    "llama-d40-g2": ("llama", dict(head_dim=40, num_attention_heads=4, num_key_value_heads=2)),
    "mistral-d48-g2-kv3": ("mistral", dict(head_dim=48, num_attention_heads=6, num_key_value_heads=3)),
    "qwen3-d80-g5": ("qwen3", dict(head_dim=80, num_attention_heads=5, num_key_value_heads=1)),
}
CASES = list(ARCHS) + list(NEW_FAMILIES) + list(SHAPES)
NEW = 5
BLOCK = 8


@pytest.fixture(scope="module")
def shape_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-shapes")
    dirs = {arch: model_dirs[arch] for arch in ARCHS + NEW_FAMILIES}
    for name, (family, overrides) in SHAPES.items():
        dirs[name] = (root / name, build_model(family, root / name, seed=3, **overrides))
    return dirs


def _prompts():
    rng = random.Random(29)
    # mixed lengths over many 8-token blocks; the first one's prefix is hit again below
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (45, 13, 29)]


def _on_triton(engine: Engine) -> None:
    model = engine.runner.model
    for layer in model.attention_layers() + (model.moe_layers() if hasattr(model, "moe_layers") else []):
        layer.backend = "triton"
    if engine.runner.kv_groups is None or not engine.runner.kv_groups.num_window_groups:
        capture_on_cpu(engine.runner, max_batch=4)  # decode steps replay the "graphs", as on CUDA


@pytest.mark.parametrize("case", CASES)
def test_engine_on_triton_kernels_matches_transformers(shape_dirs, monkeypatch, case):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path, hf = shape_dirs[case]
    engine = Engine(EngineConfig(model=str(path), num_blocks=160, block_size=BLOCK, max_num_batched_tokens=24,
                                 max_num_seqs=8), show_progress=False)
    _on_triton(engine)
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    batch = _prompts()
    refs = [reference(hf, p, NEW) for p in batch]

    # a batch of mixed lengths, prefilled in 24-token chunks beside the others' decodes
    for out, ref in zip(engine.generate(batch, greedy), refs):
        assert_greedy_equal(out.outputs[0].token_ids, *ref)

    # a prefix-cache hit: the first prompt's first 32 tokens are cached, 5 new ones follow
    hit = batch[0][:32] + [7, 8, 9, 10, 11]
    out = engine.generate([hit], greedy)[0]
    assert out.prefix_hit_tokens >= 24
    assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, hit, NEW))

    # n = 2 variants of one prompt (forked after the prefill, copy-on-write of the shared last block)
    for variant in engine.generate([batch[2]], greedy.with_(n=2))[0].outputs:
        assert_greedy_equal(variant.token_ids, *refs[2])

    # a fork of a pinned branch: the child continues from the parent's blocks
    parent = engine.generate([batch[1]], greedy.with_(max_tokens=2), keep=True)[0].outputs[0]
    child = engine.fork(parent.handle, greedy.with_(max_tokens=NEW - 2))
    while not engine.is_finished(child):
        engine.step()
    assert_greedy_equal(parent.token_ids + engine.pop_output(child).outputs[0].token_ids, *refs[1])
    engine.release(parent.handle)
    engine.check_invariants()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("case", ["llama", "gemma3"])   # gemma3: window layer groups, each with its own table
def test_the_prefill_warm_up_runs_every_size_class_and_leaves_the_pool_alone(shape_dirs, monkeypatch, case):
    """CUDA runners compile each prefill size class's kernels at start-up (ModelRunner._warm_prefill_kernels).
    Here on the Triton kernels under the interpreter: a live pool comes out of it byte for byte, and the engine
    still gives transformers' greedy tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path, hf = shape_dirs[case]
    config = EngineConfig(model=str(path), num_blocks=64, block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4)
    engine = Engine(config, show_progress=False)
    _on_triton(engine)
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    prompt = _prompts()[0]
    first = engine.generate([prompt], greedy, keep=True)[0].outputs[0]   # blocks in use while it warms
    pool = [c.clone() for c in engine.runner.k_caches + engine.runner.v_caches]
    lengths = []
    forward = engine.runner.model.forward
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner.model, "forward", lambda ids, *a, **kw: lengths.append(len(ids)) or
                      forward(ids, *a, **kw))
        patch.setattr(torch.cuda, "synchronize", lambda *a: None)
        engine.runner._warm_prefill_kernels(dataclasses.replace(config, max_num_batched_tokens=80))
    assert lengths == [64, 80, 80]    # each class's length, cut to the step budget
    for before, after in zip(pool, engine.runner.k_caches + engine.runner.v_caches):
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))   # bits: unused blocks may hold NaN
    assert_greedy_equal(first.token_ids, *reference(hf, prompt, NEW))
    child = engine.fork(first.handle, greedy)
    while not engine.is_finished(child):
        engine.step()
    assert_greedy_equal(first.token_ids + engine.pop_output(child).outputs[0].token_ids,
                        *reference(hf, prompt, 2 * NEW))
