"""DecodeGraphs' static buffers, padding and capture ladder, run on CPU: a test double for CUDA graphs
(tests/graph_double.py) re-runs the recorded step on the static buffers, as a replay does, with the Triton
kernels (attention and the fused layer kernels) under the interpreter. Before every replay the static buffers
are poisoned with what an earlier, larger step could have left there: a row that read a stale id, position or
slot would crash or change the tokens."""

from __future__ import annotations

import pytest
import torch

from oracle import assert_greedy_equal, reference
from pagedchat import kernels as K
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.runner import DecodeGraphs, graph_sizes
from graph_double import capture_on_cpu
from triton_rounding import gpu_rounding

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")


def test_capture_ladder():
    assert graph_sizes(1) == [1] and graph_sizes(3) == [1, 2, 3] and graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    ladder = graph_sizes(512)
    assert ladder[-1] == 512 and ladder == sorted(set(ladder)) and {256, 288, 480} <= set(ladder)
    assert all(b - a <= (16 if b <= 256 else 32) for a, b in zip(ladder, ladder[1:]))
    config = EngineConfig(model="m", max_num_seqs=256, num_draft_tokens=6)
    assert DecodeGraphs.rows_for(config) == (512, 7)
    assert DecodeGraphs.rows_for(EngineConfig(model="m", max_num_seqs=4, num_draft_tokens=3)) == (16, 4)


def graphed_engine(model_dirs, monkeypatch, arch="llama", **kw) -> tuple[Engine, list]:
    """A CPU engine whose decode and verify steps replay DecodeGraphs through the double; the list records
    each replay's (rows, padded size, a verify step)."""
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "0")
    config = EngineConfig(model=str(model_dirs[arch][0]), num_blocks=64, max_num_seqs=4, num_draft_tokens=3,
                          fused_kernels=True, **kw)
    engine = Engine(config, show_progress=False)
    runner = engine.runner
    for layer in runner.attention_layers:
        layer.backend = "triton"
    runner.model.use_fused_kernels("triton")
    graphs = capture_on_cpu(runner, *DecodeGraphs.rows_for(config))
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    replays, replay = [], graphs.replay
    vocab = engine.loaded.spec.vocab_size

    def poisoned_replay(ids, positions, meta):
        graphs.ids.fill_(vocab + 7)                       # an id the embedding refuses
        graphs.positions.fill_(engine.max_model_len - 1)  # a real but wrong position
        graphs.slots.fill_(0)                             # a live slot: a stale write would corrupt it
        graphs.seq_lens.fill_(5)
        graphs.tables.fill_(1)
        out = replay(ids, positions, meta)
        size = next(s for s in graphs.sizes if s >= ids.shape[0])
        assert (graphs.slots[ids.shape[0]:size] == -1).all() and (graphs.seq_lens[ids.shape[0]:size] == 0).all()
        replays.append((ids.shape[0], size, not meta.is_decode))
        return out

    graphs.replay = poisoned_replay
    return engine, replays


@needs_triton
def test_padded_decode_replays_match_transformers(model_dirs, monkeypatch):
    """Three sequences replay the 4-row graph (one padding row), then two the 2-row one, as they finish."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine, replays = graphed_engine(model_dirs, monkeypatch)
    hf = model_dirs["llama"][1]
    prompts = [[5, 9, 11, 40, 7, 3, 8, 21, 30], [17, 4, 99, 12, 6, 13, 2, 15, 31, 44], [8, 8, 9]]
    with gpu_rounding():
        outs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                         for n in (5, 3, 5)])
    for prompt, out, n in zip(prompts, outs, (5, 3, 5)):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, n))
    assert (3, 4, False) in replays and (2, 2, False) in replays
    engine.check_invariants()


@needs_triton
def test_verify_steps_replay_the_decode_graphs(model_dirs, monkeypatch):
    """n-gram speculation at batch 1 (drafts copied from a related stream holding the right continuation with
    one wrong token, as an edit-like workload): each verify step (1 + k tokens of one sequence) replays a graph
    as k + 1 rows over the sequence's table, and the tokens stay transformers' greedy tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine, replays = graphed_engine(model_dirs, monkeypatch, speculate="ngram")
    hf = model_dirs["llama"][1]
    prompt = [5, 9, 11, 40, 7, 3, 8, 21, 30, 12]
    ref_tokens, ref_logits = reference(hf, prompt, 12)
    edited = prompt + ref_tokens[:6] + [(ref_tokens[6] + 1) % 300] + ref_tokens[7:]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with gpu_rounding():
        rid = engine.add_request(prompt, params, context=[edited])
        for _ in engine.steps([rid]):
            pass
    assert_greedy_equal(engine.pop_output(rid).outputs[0].token_ids, ref_tokens, ref_logits)
    assert any(verify and rows > 1 for rows, _, verify in replays), replays
    engine.check_invariants()
