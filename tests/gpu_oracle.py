"""transformers on the same GPU as the oracle of the CUDA tests, and float64 as the arbiter of a divergence.

A greedy divergence is accepted only where it is no error: the fp32 reference's top-2 logit gap is a near-tie
(oracle.NEAR_TIE), or a float64 run of the same model picks pagedchat's token. Anything else fails with the
position, both tokens, the reference's top-2 gap and the float64 run's pick, which is what tells a near-tie
from a bug.
"""

from __future__ import annotations

import copy
import functools

import torch

from oracle import NEAR_TIE

DEVICE = "cuda"   # a CPU dry run of the GPU tests' logic sets "cpu"


@functools.lru_cache(maxsize=None)
def on_cuda(hf_model, dtype: torch.dtype = torch.float32):
    """A copy of the (CPU, fp32) test model on the GPU in `dtype`."""
    return copy.deepcopy(hf_model).to(device=DEVICE, dtype=dtype).eval()


def cuda_reference(hf_model, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32):
    """transformers' greedy tokens and per-step logits, on the GPU."""
    model = on_cuda(hf_model, dtype)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float().cpu() for step in out.logits]


def float64_pick(hf_model, context: list[int]) -> tuple[int, float]:
    """The next token a float64 run of the model picks after `context`, and its top-2 gap."""
    model = on_cuda(hf_model, torch.float64)
    with torch.inference_mode():
        logits = model(torch.tensor([context], device=DEVICE)).logits[0, -1]
    top2 = logits.topk(2)
    return int(top2.indices[0]), float(top2.values[0] - top2.values[1])


def divergence(hf_model, prompt: list[int], ours: list[int], ref_tokens: list[int],
               ref_logits: list[torch.Tensor]) -> str | None:
    """None when `ours` is a correct greedy continuation; else what went wrong, in one line."""
    for i, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a == b:
            continue
        top2 = ref_logits[i].topk(2).values
        gap = float(top2[0] - top2[1])
        if gap < NEAR_TIE and ref_logits[i][a] >= top2[1] - NEAR_TIE:
            return None       # a near-tie: either token is right, and the continuations part here
        pick, gap64 = float64_pick(hf_model, prompt + ref_tokens[:i])
        if pick == a:
            return None       # float64 agrees with pagedchat: transformers' fp32 rounding flipped a close call
        arbiter = "transformers'" if pick == b else f"neither ({pick})"
        return (f"prompt of {len(prompt)} tokens, new token {i}: pagedchat {a} != transformers {b}; the reference's "
                f"top-2 logit gap {gap:.3g}; float64 picks {arbiter} token (its gap {gap64:.3g})")
    if len(ours) != len(ref_tokens):
        return f"prompt of {len(prompt)} tokens: {len(ours)} tokens against transformers' {len(ref_tokens)}"
    return None
