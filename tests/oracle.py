"""Compare pagedchat's greedy tokens with transformers' generate(do_sample=False), allowing a mismatch only
at a real near-tie of the reference's logits (checked, not assumed)."""

from __future__ import annotations

import contextlib

import torch

NEAR_TIE = 1e-4  # top-2 logit gap (fp32) below which either token is a correct greedy choice


def reference(hf_model, prompt: list[int], max_new_tokens: int):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [l[0] for l in out.logits]


def assert_greedy_equal(ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a == b:
            continue
        top2 = ref_logits[i].float().topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < NEAR_TIE and ref_logits[i][a] >= top2[1] - NEAR_TIE, (
            f"token {i}: pagedchat {a} != transformers {b}, and the reference's top-2 gap {gap:.3g} is no tie")
        return  # after a legitimate tie the continuations differ; the prefix up to it matched
    assert len(ours) == len(ref_tokens), f"lengths differ: {len(ours)} vs {len(ref_tokens)}\n{ours}\n{ref_tokens}"


@contextlib.contextmanager
def quantized_kv_cache(dtype: torch.dtype):
    """transformers' KV caches store every new token's K and V quantized and read back as values x scales,
    exactly as pagedchat's quantized pool does (pagedchat/kernels/kv_quant.py): within this block,
    `reference` is the oracle of an int8 / fp8 pool (the model's own numbers otherwise untouched)."""
    from transformers import cache_utils

    from pagedchat.kernels.kv_quant import dequantize_kv, quantize_kv

    layers = (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer)
    saved = {cls: cls.__dict__["update"] for cls in layers}

    def quantizing(update):
        def quantized_update(self, key_states, value_states, *args, **kwargs):
            key_states, value_states = (dequantize_kv(*quantize_kv(x, dtype), x.dtype)
                                        for x in (key_states, value_states))
            return update(self, key_states, value_states, *args, **kwargs)
        return quantized_update

    for cls, update in saved.items():
        cls.update = quantizing(update)
    try:
        yield
    finally:
        for cls, update in saved.items():
            cls.update = update
