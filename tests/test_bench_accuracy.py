"""`pagedchat bench accuracy`: the measurements themselves (perplexity against transformers, agreement, the demo
text's scored spans) and the command on a tiny random model. No accuracy of a mode is asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from pagedchat.bench import accuracy as A
from pagedchat.cli import app


def test_greedy_agreement_counts_up_to_the_first_divergence():
    r = A.greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert r == {"first_divergence": [2, 4], "tokens_agreeing": 6 / 8, "prompts_identical": 1, "prompts": 2}


def test_windows_keep_what_is_scored():
    windows = A.text_windows(list(range(10)), [True] * 6 + [False] * 4, 4)
    assert windows == [([0, 1, 2, 3], [True] * 4), ([4, 5, 6, 7], [True, True, False, False])]  # [8, 9]: nothing


def test_perplexity_is_transformers_nll(model_dirs):
    """The engine's prompt scoring gives the same perplexity as transformers' logits on the same window, the
    unscored tokens left out."""
    from transformers import AutoModelForCausalLM

    from pagedchat.engine import Engine, EngineConfig

    path, _ = model_dirs["llama"]
    ids = list(range(5, 45))
    scored = [i % 3 != 0 for i in range(len(ids))]
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64), show_progress=False)
    got = A.perplexity(engine, [(ids, scored)])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])][torch.tensor(scored[1:])]
    assert math.isclose(got, math.exp(nll.mean().item()), rel_tol=1e-4)


def test_demo_text_scores_the_replies_only():
    from pagedchat.demo.evaluate import DEFAULT_MODEL
    from pagedchat.model.loader import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL, False, None)
    ids, scored = A.demo_text(tok)
    assert len(ids) == len(scored) and 0.3 < sum(scored) / len(scored) < 0.9
    replies = tok.decode([t for t, keep in zip(ids[:400], scored[:400]) if keep])
    users = tok.decode([t for t, keep in zip(ids[:400], scored[:400]) if not keep])
    assert "user" not in replies and "<|im_start|>assistant" in users and "=" in replies


def bench(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", "accuracy", *args, "--json"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads(result.stdout)


def test_accuracy_command_on_a_random_model():
    """Without a tokenizer only greedy agreement is measured; fp is the reference and agrees with itself."""
    r = bench("--random", "llama", "--random-size", "tiny", "--modes", "int4", "--tokens", "6", "--prompts", "2",
              "--device", "cpu")
    assert list(r["modes"]) == ["fp", "int4"] and r["machine"]
    assert r["modes"]["fp"]["greedy"]["tokens_agreeing"] == 1.0
    assert len(r["modes"]["int4"]["greedy"]["first_divergence"]) == 2
    assert "perplexity" not in r["modes"]["int4"] and r["questions"] == 0


@pytest.mark.parametrize("modes, line", [("int3", "--modes takes fp, int8, int4, kv-int8, kv-fp8; got 'int3'")])
def test_a_mode_it_cannot_run_is_one_line(pagedchat_cli, modes, line):
    code, _, err = pagedchat_cli("bench", "accuracy", "--modes", modes)
    assert code == 2 and err.strip().splitlines() == [f"pagedchat: error: {line}"]


@pytest.mark.parametrize("native", [True, False])
def test_teacher_forced_logits_follow_a_window_model_past_its_window(model_dirs, native):
    """The teacher-forced pass (the logit error of `bench accuracy`) gives each layer group its own blocks: on
    Gemma 3 (window 24, blocks of 8) its logits pick the greedy tokens the engine itself generated, well past
    the window, on the native step and on the torch path."""
    from pagedchat.bench.int8_accuracy import teacher_forced_logits
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(model_dirs["gemma3"][0]), device="cpu", num_blocks=96, block_size=8,
                                 enable_prefix_cache=False), show_progress=False)
    if not native:
        engine.runner.native = engine.runner._native_next_try = None
    prompt = [5 + i for i in range(30)]
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    tokens = greedy.outputs[0].token_ids
    logits = teacher_forced_logits(engine, prompt, tokens)
    assert logits.argmax(-1).tolist() == tokens
