"""The engine's public surface as the front ends use it: the one step driver, Branch handles, typed fit
errors, capacity; and the one sampling rule (keys, layers, stop strings) shared by run, chat and serve."""

from contextlib import closing
from dataclasses import fields
from types import SimpleNamespace

import pytest

from fake_runner import fake_engine
from pagedchat.engine import Branch, SamplingParams
from pagedchat.engine.core.sampling_params import SETTING_KEYS
from pagedchat.errors import ContextTooLong, EmptyPrompt, PoolTooSmall, TooManyVariants


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_steps_drives_given_requests_to_the_end_and_yields_only_their_events():
    engine, _ = fake_engine(num_blocks=32, block_size=8)
    mine = engine.add_request([2, 3, 4], greedy(5))
    other = engine.add_request([5, 6, 7], greedy(20))
    seen = [e for events in engine.steps([mine]) for e in events]
    assert {e.request_id for e in seen} == {mine} and len(seen) == 5
    assert engine.is_finished(mine) and not engine.is_finished(other)
    assert engine.pop_output(mine).outputs[0].finish_reason == "length"
    for _ in engine.steps():   # None: until the engine has no work
        pass
    assert engine.is_finished(other) and engine.pop_output(other).outputs[0].finish_reason == "length"


def test_closing_the_driver_early_aborts_and_frees_the_blocks():
    engine, _ = fake_engine(num_blocks=32, block_size=8)
    rid = engine.add_request([2, 3, 4, 5], greedy(50, n=3))
    with closing(engine.steps([rid])) as steps:
        for i, _ in enumerate(steps):
            if i == 4:
                break
    assert engine.is_finished(rid)
    out = engine.pop_output(rid)
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 3
    engine.check_invariants()
    assert engine.pool_stats().used == 0


def test_a_pinned_branch_is_a_typed_handle_the_next_turn_continues_from():
    engine, _ = fake_engine(num_blocks=32, block_size=8)
    rid = engine.add_request([2, 3, 4, 5, 6], greedy(4), keep=True)
    for _ in engine.steps([rid]):
        pass
    branch = engine.pop_output(rid).outputs[0].handle
    assert isinstance(branch, Branch) and branch.is_pinned and branch.num_tokens == 9
    assert engine.blocks_held([branch]) == 1 and engine.stats().pinned == 1  # 8 tokens have KV: 1 block
    follow = engine.add_request(branch.token_ids + [7, 8], greedy(2), keep=True, parent=branch)
    for _ in engine.steps([follow]):
        pass
    assert engine.pop_output(follow).prefix_hit_tokens == 8   # every computed token of the branch
    engine.release(branch)
    assert not branch.is_pinned and engine.blocks_held([branch]) == 0


def test_fit_checks_raise_typed_errors_with_their_numbers():
    engine, _ = fake_engine(num_blocks=4, block_size=8, max_model_len=64, max_num_seqs=8)
    assert engine.capacity_tokens == 32 and engine.pool_stats().capacity_tokens == 32
    with pytest.raises(EmptyPrompt):
        engine.add_request([], greedy(1))
    with pytest.raises(TooManyVariants) as e:
        engine.add_request([2, 3], greedy(1, n=9))
    assert (e.value.n, e.value.limit) == (9, 8)
    with pytest.raises(ContextTooLong) as e:
        engine.check_prompt([2] * 64)
    assert (e.value.prompt_tokens, e.value.max_model_len) == (64, 64)
    with pytest.raises(PoolTooSmall) as e:
        engine.check_prompt([2] * 40)
    assert (e.value.prompt_tokens, e.value.capacity_tokens, e.value.num_blocks) == (40, 32, 4)
    assert "kv_memory" in str(e.value) and "--" not in str(e.value)   # the engine names settings, not flags
    assert e.value.advise("raise --kv-memory").endswith("(4 blocks); raise --kv-memory")


# -- one sampling rule -------------------------------------------------------------------------------------------
def test_every_front_end_takes_the_sampling_keys_samplingparams_declares():
    from pagedchat.chat.options import SET_KEYS
    from pagedchat.serve.app import SAMPLING_FIELDS
    from pagedchat.settings import SamplingOptions

    assert SETTING_KEYS == ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty",
                            "stop")
    assert tuple(f.name for f in fields(SamplingOptions)) == SETTING_KEYS == SET_KEYS
    assert set(SAMPLING_FIELDS) == set(SETTING_KEYS) - {"max_tokens", "stop"}


class _Entry:
    """A registry entry whose model settings are given (the part resolve_sampling reads)."""

    def __init__(self, **values):
        self.values = values

    def sampling_defaults(self):
        return {k: SimpleNamespace(value=v, source="models.toml [models.m]") for k, v in self.values.items()}


def test_user_stop_strings_are_added_to_the_models_in_the_cli_and_the_server_alike():
    from pagedchat.serve.app import ServeSettings, _sampling_params
    from pagedchat.settings import SamplingOptions, resolve_sampling

    model = {"stop": ["<end>"], "temperature": 0.5, "max_tokens": 40}
    cli, sources = resolve_sampling(_Entry(**model), SamplingOptions(stop=["\n\n"], top_k=3))
    body = SimpleNamespace(temperature=None, top_p=None, top_k=3, min_p=None, repetition_penalty=None, seed=None,
                           stop="\n\n", n=1, ignore_eos=False, use_beam_search=False)
    server = _sampling_params(body, None, ServeSettings("m", sampling_defaults=model))
    assert cli == server
    assert cli.stop == ["<end>", "\n\n"] and cli.temperature == 0.5 and cli.top_k == 3 and cli.max_tokens == 40
    assert sources["stop"] == "models.toml [models.m] + command-line flag"
    # without a user stop, the model's alone; a layer above the model wins every other key
    alone, _ = resolve_sampling(_Entry(**model), SamplingOptions(), {"temperature": 0.0, "__source__": "/set"})
    assert alone.stop == ["<end>"] and alone.temperature == 0.0


def test_front_ends_reach_the_engine_only_through_its_api():
    """chat, serve and the commands never read the engine's pool, scheduler, requests or runner."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "pagedchat"
    internal = re.compile(r"\.(pool|scheduler|requests|runner)\b")
    hits = [f"{path.relative_to(root)}:{number}: {line.strip()}"
            for folder in ("chat", "serve", "commands") for path in sorted((root / folder).rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if internal.search(line)]
    assert hits == []
