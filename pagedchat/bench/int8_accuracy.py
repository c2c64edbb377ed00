"""Accuracy of `--quantize int8` (or another quantized mode: `--kv-dtype int8`) against fp32 on one model:
greedy agreement and the largest logit error.

Greedy agreement counts generated tokens equal to the fp32 engine's up to each prompt's first divergence
(after one differing token the continuations differ by construction). The logit error is teacher-forced on the
fp32 tokens the way the engine computes them: one prefill of the prompt, then one decode step per token (decode
and prefill take different int8 matmuls, see model/quantize.py; on CPU a decode step of a Llama-family model is
the native step, pagedchat/native, whose int8 matmul keeps fp32 activations); it is reported in logits and relative to the
fp32 logits' spread at that position. A divergence counts as a near-tie when fp32's top-2 logit gap at that
position is at most twice the int8 error there (two logits each moved by that much can swap).
"""

from __future__ import annotations

import torch

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.attention import AttentionMetadata


def _engine(path: str, num_blocks: int, **setting) -> Engine:
    # No prefix cache: the teacher-forced passes below write into the pool's first blocks directly.
    config = EngineConfig(model=path, device="cpu", num_blocks=num_blocks, enable_prefix_cache=False, **setting)
    return Engine(config, show_progress=False)


def _forward(runner, ids: list[int], start: int, blocks: int) -> torch.Tensor:
    """Logits of `ids` placed at positions start.. of one sequence that owns blocks 0..blocks-1 in every layer
    group (group g's are g * blocks.. : a model with sliding-window groups keeps each group's K/V in blocks of its
    own); a decode step on the native CPU step when the engine has it, as the engine runs it."""
    n, end, bs = len(ids), start + len(ids), runner.block_size

    def meta_of(group: int) -> AttentionMetadata:
        first = group * blocks
        return AttentionMetadata(slot_mapping=torch.arange(start, end) + first * bs,
                                 block_tables=torch.arange(first, first + blocks, dtype=torch.int32)[None],
                                 seq_lens=torch.tensor([end], dtype=torch.int32),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), is_decode=n == 1,
                                 max_seq_len=end)
    meta = meta_of(0)
    windows = [meta_of(g) for g in range(1, 1 + runner._window_groups())]
    meta.window_metas = windows or None
    if n == 1 and runner.native is not None:
        return runner.native.step(torch.tensor(ids), torch.arange(start, end), meta.block_tables, meta.cu_seqlens_q,
                                  [m.block_tables for m in windows])
    model = runner.model
    return model.compute_logits(model(torch.tensor(ids), torch.arange(start, end), meta))


@torch.inference_mode()
def teacher_forced_logits(engine: Engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab]: the logits that predicted each continuation token."""
    runner = engine.runner
    blocks = -(-(len(prompt) + len(continuation)) // runner.block_size)
    groups = 1 + runner._window_groups()
    if groups * blocks > engine.pool_stats().num_blocks:
        raise ValueError(f"the pool has {engine.pool_stats().num_blocks} blocks; this pass needs {groups * blocks}")
    rows = [_forward(runner, prompt, 0, blocks)[-1]]
    for i, token in enumerate(continuation[:-1]):
        rows.append(_forward(runner, [token], len(prompt) + i, blocks)[0])
    return torch.stack(rows)


def measure(path: str, prompts: list[list[int]], tokens: int, setting: dict | None = None,
            num_blocks: int = 128) -> dict:
    """A quantized mode against fp32 on `prompts`, `tokens` greedy tokens each. setting: the mode's
    EngineConfig fields (default {"quantize": "int8"}; {"kv_dtype": "int8"}: the quantized KV pool)."""
    quantized = setting or {"quantize": "int8"}
    engines = {None: _engine(path, num_blocks), "int8": _engine(path, num_blocks, **quantized)}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = {q: [o.outputs[0].token_ids for o in e.generate(prompts, params)] for q, e in engines.items()}
    agree = total = near_ties = 0
    max_err = rel_err = 0.0
    first_divergence = []
    for prompt, ref, got in zip(prompts, outs[None], outs["int8"]):
        same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        agree, total = agree + same, total + len(ref)
        first_divergence.append(same)
        fp, q8 = (teacher_forced_logits(engines[q], prompt, ref) for q in (None, "int8"))
        err = (q8 - fp).abs().amax(dim=-1)
        spread = fp.amax(dim=-1) - fp.amin(dim=-1)
        max_err, rel_err = max(max_err, err.max().item()), max(rel_err, (err / spread).max().item())
        if same < len(ref):  # a flip is explained when fp32's top-2 gap there is within both errors
            top2 = fp[same].topk(2).values
            near_ties += int((top2[0] - top2[1]).item() <= 2 * err[same].item())
    identical = sum(a == b for a, b in zip(outs[None], outs["int8"]))
    return {"greedy_agreement": agree / total, "identical_prompts": identical, "prompts": len(prompts),
            "divergences_at_near_ties": near_ties, "max_logit_error": max_err, "max_logit_error_rel_spread": rel_err,
            "first_divergence": first_divergence}
