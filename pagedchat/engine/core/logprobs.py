"""Log-probabilities of chosen tokens and their top-k alternatives, reduced on the device to a few numbers.

Which distribution: the model's, after the repetition penalty and before temperature, top-k/top-p/min-p and
grammar masks: the numbers do not change with the sampling settings (what OpenAI's API returns, and vLLM's
default `raw_logprobs` except that a repetition penalty, when asked for, is part of the model's scores here).
At temperature 0 this is exactly log_softmax of the logits the token was picked from.

Prompt log-probabilities (echo) are computed chunk by chunk during prefill and only the requested values
are kept: never a full-vocabulary row per prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedchat.engine.core.sampling_params import MAX_TOP_LOGPROBS  # noqa: F401  (re-exported)

if TYPE_CHECKING:   # TokenLogprob is an output type of the torch-free one-shot path too (pagedchat/quick)
    import torch

ROWS_PER_PASS = 256      # LM-head rows per pass when scoring a prompt chunk: bounds the [rows, vocab] temporary


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # best first, up to the requested k


def reduce_rows(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """log_softmax each row; keep the chosen token's value and the top k."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, chosen[:, None].to(logprobs.device))[:, 0].tolist()
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in picked]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(chosen.tolist(), picked, tops)]


def score_prompt_chunk(compute_logits, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Row i of `hidden` predicts targets[i]; the LM head runs ROWS_PER_PASS rows at a time."""
    import torch

    assert hidden.shape[0] == len(targets)
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), ROWS_PER_PASS):
        rows = hidden[start:start + ROWS_PER_PASS]
        chosen = torch.tensor(targets[start:start + ROWS_PER_PASS], device=hidden.device)
        out.extend(reduce_rows(compute_logits(rows), chosen, k))
    return out
