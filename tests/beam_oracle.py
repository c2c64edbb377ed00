"""transformers' beam search as the oracle: `generate(num_beams=W, num_return_sequences=W, do_sample=False)`.

With W = 1 transformers runs greedy search and reports no score; the score is then the same formula beam
search uses, sum of the chosen tokens' log-probabilities / generated_length ** length_penalty."""

from __future__ import annotations

import torch

REL_TOL = 1e-4


def beam_reference(hf_model, prompt: list[int], width: int, max_new_tokens: int, length_penalty: float = 1.0,
                   early_stopping=False) -> list[tuple[list[int], float]]:
    """Every hypothesis, best first, as (generated token ids, score)."""
    out = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                            max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping, output_scores=True, output_logits=width == 1,
                            return_dict_in_generate=True, pad_token_id=0)
    generated = out.sequences[:, len(prompt):]
    if width == 1:
        tokens = generated[0].tolist()
        eos = hf_model.generation_config.eos_token_id
        if eos in tokens:
            tokens = tokens[:tokens.index(eos) + 1]
        logprob = sum(l[0].float().log_softmax(-1)[t].item() for l, t in zip(out.logits, tokens))
        return [(tokens, logprob / len(tokens) ** length_penalty)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(generated[i, :lengths[i]].tolist(), out.sequences_scores[i].item()) for i in range(width)]


def assert_beams_equal(outputs, reference) -> None:
    """Same hypotheses in the same order, scores within REL_TOL (relative)."""
    assert len(outputs) == len(reference), f"{len(outputs)} hypotheses, transformers has {len(reference)}"
    for rank, (ours, (tokens, score)) in enumerate(zip(outputs, reference)):
        assert ours.token_ids == tokens, f"hypothesis {rank}: {ours.token_ids} != transformers' {tokens}"
        assert abs(ours.score - score) <= REL_TOL * abs(score), f"hypothesis {rank}: score {ours.score} vs {score}"
