"""Log-probabilities from the engine equal transformers' log_softmax: generated tokens (with top-k), and
prompt tokens (echo) scored during prefill, in one piece or in chunks, with a warm prefix cache, under
preemption and with n variants."""

import json

import pytest
import torch

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.errors import UserError

PROMPTS = [[5, 17, 40, 99, 123, 7, 7, 250, 31, 64, 12, 300, 8, 45, 77, 190, 3, 66, 201, 150, 19, 88, 240],
           [9, 44, 101, 6, 260, 33, 12, 12, 90]]
K = 5


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution over token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches(scored, ref: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(scored) == len(targets)
    for item, row, target in zip(scored, ref, targets):
        assert item.token_id == target
        assert item.logprob == pytest.approx(row[target].item(), abs=1e-4)
        values, ids = row.topk(k)
        assert [lp for _, lp in item.top] == pytest.approx(values.tolist(), abs=1e-4)
        gaps = (values[:-1] - values[1:]).abs()
        if k and bool((gaps > 1e-4).all()):   # no near-tie inside the top k: the ids are determined
            assert [t for t, _ in item.top] == ids.tolist()


def engine(model_dirs, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dirs["llama"][0]), **{"num_blocks": 64, **kw}), show_progress=False)


@pytest.mark.parametrize("chunk", [2048, 7])
def test_prompt_and_output_logprobs_equal_transformers(model_dirs, chunk):
    hf = model_dirs["llama"][1]
    eng = engine(model_dirs, max_num_batched_tokens=chunk, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=K, prompt_logprobs=K, ignore_eos=True)
    for _ in range(2):   # the second round would hit the prefix cache: scoring must not skip those blocks
        for prompt, out in zip(PROMPTS, eng.generate(PROMPTS, params)):
            full = prompt + out.outputs[0].token_ids
            ref = hf_logprobs(hf, full)
            assert_matches(out.prompt_logprobs, ref[:len(prompt) - 1], prompt[1:], K)
            assert_matches(out.outputs[0].logprobs, ref[len(prompt) - 1:-1], out.outputs[0].token_ids, K)
            # greedy: every chosen token is the top alternative
            assert all(lp.logprob == lp.top[0][1] for lp in out.outputs[0].logprobs)
    eng.check_invariants()


def test_logprobs_with_sampling_variants_and_preemption(model_dirs):
    """Sampled variants: each token's logprob is the model's (before temperature), whatever was drawn."""
    hf = model_dirs["llama"][1]
    eng = engine(model_dirs, num_blocks=10, block_size=8)
    params = SamplingParams(temperature=1.5, top_k=50, seed=3, max_tokens=12, n=3, logprobs=2, prompt_logprobs=0,
                            ignore_eos=True)
    out = eng.generate([PROMPTS[0]], params)[0]
    assert len(out.prompt_logprobs) == len(PROMPTS[0]) - 1 and all(not lp.top for lp in out.prompt_logprobs)
    for variant in out.outputs:
        ref = hf_logprobs(hf, PROMPTS[0] + variant.token_ids)
        assert_matches(variant.logprobs, ref[len(PROMPTS[0]) - 1:-1], variant.token_ids, 2)
    eng.check_invariants()


def test_no_logprobs_unless_asked(model_dirs):
    out = engine(model_dirs).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("prompt_logprobs", -1), ("logprobs", 1.5)])
def test_bad_logprobs_values_are_user_errors(field, value):
    with pytest.raises(UserError, match=field):
        SamplingParams(**{field: value})


def test_run_json_logprobs_equal_transformers(pagedchat_cli, model_dirs):
    path, hf = model_dirs["llama"]
    code, out, err = pagedchat_cli("run", "-m", str(path), "--raw", "--temperature", "0", "--json", "--max-tokens",
                                   "5", "--logprobs", "3", "hello world")
    assert code == 0, err
    output = json.loads(out)["outputs"][0]
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(path)("hello world").input_ids
    ref = hf_logprobs(hf, prompt + output["token_ids"])[len(prompt) - 1:-1]
    assert [e["token_id"] for e in output["logprobs"]] == output["token_ids"]
    for entry, row, token in zip(output["logprobs"], ref, output["token_ids"]):
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token_id"] == token


def test_run_logprobs_needs_json(pagedchat_cli, model_dirs):
    code, _, err = pagedchat_cli("run", "-m", str(model_dirs["llama"][0]), "--logprobs", "2", "hi")
    assert code != 0 and "--json" in err and "Traceback" not in err
