"""The quick path (pagedchat/quick): `run` on a GGUF file the native step covers answers without torch, with the
tokens the engine's native step gives for the same file and prompt.

The oracle is the engine with every step on the native step (PAGEDCHAT_NATIVE=always): the same arithmetic, so
the tokens must be identical, not merely close (the engine itself is held to transformers by
tests/test_gguf_families.py and to the native step's twin by tests/test_native_gguf.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_models import build_hf, write_gguf
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.native import build



@pytest.fixture(scope="module", autouse=True)
def native_library():
    """Loaded once the session's build folder is set (conftest.py), where the CLI subprocesses find it too."""
    if build.load(wait=True) is None:
        pytest.skip("no native build here (no C compiler?)")

WIDE = dict(hidden_size=256, intermediate_size=512)
# (family, the matrices' format): Llama's forward with Q/K rows the converter permuted; Gemma 3's window layers,
# two rope settings and norms stored as w + 1, in a K-quant.
FILES = {"llama": "Q8_0", "gemma3": "Q4_K"}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 12, 64, 3, 77, 180], list(range(3, 53))]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"quick-{arch}")
            hf = build_hf(arch, root / "hf", **WIDE)
            made[arch] = root / f"{arch}-{FILES[arch]}.gguf"
            write_gguf(hf, root / "hf", made[arch], arch, FILES[arch])
        return made[arch]

    return get


@pytest.fixture
def native_always(monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")


def quick_engine(path, **config):
    from pagedchat import quick

    eng = quick.open_engine(EngineConfig(model=str(path), device="cpu", **config))
    assert eng is not None, "the quick path declined a file it covers"
    return eng


def quick_tokens(eng, prompt, params=GREEDY) -> list[int]:
    rid = eng.add_request(prompt, params)
    for _ in eng.steps():
        pass
    return eng.pop_output(rid).outputs[0].token_ids


def engine_reference(path, prompt, params=GREEDY):
    """The engine's tokens and, at each, its two best log-probabilities."""
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64), show_progress=False)
    assert eng.runner.native is not None
    out = eng.generate([prompt], params.with_(logprobs=2))[0].outputs[0]
    return out.token_ids, [[lp for _, lp in entry.top] for entry in out.logprobs]


def assert_same_tokens(ours: list[int], theirs: list[int], top2: list[list[float]]) -> None:
    """Identical, or different from a step where the engine's two best tokens tie within NEAR_TIE (the rotary
    tables may differ by an ulp of a frequency: quick/model.py _inv_freq) and ours is one of them."""
    from oracle import NEAR_TIE

    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert top2[i][0] - top2[i][1] < NEAR_TIE, f"token {i}: {a} != {b} where the engine's top-2 gap is " \
                                                      f"{top2[i][0] - top2[i][1]:.3g}, no tie"
            return
    assert ours == theirs


@pytest.mark.parametrize("arch", FILES)
def test_greedy_tokens_are_the_engines_native_step_tokens(gguf_file, native_always, arch):
    """And the first token's two best log-probabilities agree to rounding: these random models' logits are so
    far apart that a wrong rotary table or norm may not change a greedy token, but it moves them."""
    path = gguf_file(arch)
    eng = quick_engine(path)
    for prompt in PROMPTS:
        tokens, top2 = engine_reference(path, prompt)
        assert_same_tokens(quick_tokens(eng, prompt), tokens, top2)
        logits = quick_engine(path)._forward(prompt, 0).astype(np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert np.allclose(np.sort(logprobs)[::-1][:2], top2[0], atol=0.02), (np.sort(logprobs)[::-1][:2], top2[0])


@pytest.mark.parametrize("arch", FILES)
def test_a_prompt_prefilled_in_chunks_gives_the_tokens_of_one_chunk(gguf_file, monkeypatch, arch):
    """Later chunks read the earlier ones' K/V from the pool: the same numbers as one step over the prompt."""
    from pagedchat.quick import engine as quick

    eng = quick_engine(gguf_file(arch))
    prompt = PROMPTS[1] * 3
    whole = quick_tokens(eng, prompt)
    monkeypatch.setattr(quick, "CHUNK", 7)
    assert quick_tokens(eng, prompt) == whole


def test_rotary_tables_are_the_torch_models_to_an_ulp_of_a_frequency(gguf_file):
    """The quick path computes cos/sin with numpy by the torch model's formula. Its frequencies are correctly
    rounded; torch's fp32 power may round one the other way: at most an ulp apart, and the tables apart by no
    more than that ulp turns a position's angle."""
    from pagedchat.model.gguf import arch as gguf_arch
    from pagedchat.model.gguf.reader import open_gguf
    from pagedchat.model.rope import TableRotary
    from pagedchat.quick.model import _rope_tables

    gguf = open_gguf([gguf_file("gemma3")])
    config = gguf_arch.config_from_gguf(gguf)
    size = 4096
    for tables, layer_type in zip(_rope_tables(config, size, gemma=True), ("full_attention", "sliding_attention")):
        theirs_freq = _torch_inv_freq(config, layer_type)
        apart = np.abs(tables.inv_freq - theirs_freq)
        assert np.all(apart <= np.spacing(theirs_freq)) and np.count_nonzero(apart) <= 4
        tables.ensure(size)
        theirs = TableRotary.from_config(config, config.head_dim, size, layer_type=layer_type)
        theirs.positions.ensure(size)
        bound = np.arange(size)[:, None] * np.concatenate((apart, apart))[None, :] + 2 ** -23
        assert np.all(np.abs(tables.cos - theirs.cos.numpy()) <= bound)
        assert np.all(np.abs(tables.sin - theirs.sin.numpy()) <= bound)


def _torch_inv_freq(config, layer_type) -> np.ndarray:
    from pagedchat.model.rope import _inv_freq

    params = config.rope_parameters[layer_type]
    return _inv_freq(config, params, config.head_dim, layer_type)[0].numpy()


def test_sampling_keeps_what_the_engines_filters_keep():
    """top-k, then top-p, then min-p over temperature-scaled logits: the same tokens survive as in the engine's
    sampler (which filters only when one of them is on), and the repetition penalty changes the same scores the
    same way."""
    from pagedchat.engine.decoding.sampler import _filter
    from pagedchat.quick.sample import _filtered_probs, _penalize

    rng = np.random.default_rng(0)
    for top_k, top_p, min_p in [(5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (40, 0.7, 0.05)]:
        scores = rng.normal(size=300).astype(np.float32) * 3
        theirs = _filter(torch.from_numpy(scores)[None], torch.tensor([top_k]), torch.tensor([top_p]),
                         torch.tensor([min_p]))[0]
        kept = _filtered_probs(scores, top_k, top_p, min_p) > 0
        assert np.array_equal(kept, torch.isfinite(theirs).numpy()), (top_k, top_p, min_p)
    logits = rng.normal(size=50).astype(np.float32)
    expected = torch.from_numpy(logits.copy())[None]
    from types import SimpleNamespace

    from pagedchat.engine.decoding.sampler import apply_repetition_penalty

    seq = SimpleNamespace(request=SimpleNamespace(params=SimpleNamespace(repetition_penalty=1.3)),
                          token_ids=[3, 3, 9, 40])
    apply_repetition_penalty(expected, [seq])
    _penalize(logits, seq.token_ids, 1.3)
    assert np.array_equal(logits, expected[0].numpy())


def test_stop_strings_and_limits_read_as_the_engines(gguf_file, native_always):
    """Each token goes through the engine's OutputProcessor: a stop string cuts the text, max_tokens ends it."""
    path = gguf_file("llama")
    eng = quick_engine(path)
    full = eng.pop_output(_run(eng, PROMPTS[0], GREEDY.with_(max_tokens=12)))
    assert full.outputs[0].finish_reason == "length" and len(full.outputs[0].token_ids) == 12
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    ours = eng.pop_output(_run(eng, PROMPTS[0], GREEDY.with_(max_tokens=12, stop=[stop]))).outputs[0]
    reference = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64), show_progress=False)
    theirs = reference.generate([PROMPTS[0]], GREEDY.with_(max_tokens=12, stop=[stop]))[0].outputs[0]
    if full.outputs[0].token_ids == reference.generate([PROMPTS[0]], GREEDY.with_(max_tokens=12))[0].outputs[0].token_ids:
        assert (ours.text, ours.token_ids, ours.finish_reason) == (theirs.text, theirs.token_ids, theirs.finish_reason)
    assert ours.finish_reason == "stop" and stop not in ours.text and text.startswith(ours.text)


def _run(eng, prompt, params) -> str:
    rid = eng.add_request(prompt, params)
    for _ in eng.steps():
        pass
    return rid


def test_a_prompt_too_large_for_the_pool_is_refused_as_the_engine_refuses_it(gguf_file):
    from pagedchat.errors import ContextTooLong, PoolTooSmall

    eng = quick_engine(gguf_file("llama"), kv_memory=2 * 2 * 2 * 64 * 4 * 32)   # 32 tokens of K and V (2 layers, 2 KV heads)
    with pytest.raises(PoolTooSmall):
        eng.add_request(list(range(3, 60)), GREEDY)
    with pytest.raises(ContextTooLong):
        quick_engine(gguf_file("llama"), max_model_len=16).add_request(list(range(3, 30)), GREEDY)


def test_what_it_does_not_run_the_engine_does(gguf_file, tmp_path, monkeypatch):
    from pagedchat import quick
    from pagedchat.quick.engine import takes

    path = str(gguf_file("llama"))
    assert quick.open_engine(EngineConfig(model=path, device="cpu")) is not None
    for refused in (dict(quantize="none"), dict(kv_dtype="int8"), dict(speculate="ngram"), dict(dtype="bfloat16"),
                    dict(device="cuda")):
        assert quick.open_engine(EngineConfig(model=path, **{"device": "cpu", **refused})) is None, refused
    monkeypatch.setenv("PAGEDCHAT_QUICK", "0")
    assert quick.open_engine(EngineConfig(model=path, device="cpu")) is None
    monkeypatch.delenv("PAGEDCHAT_QUICK")
    f32 = tmp_path / "f32.gguf"   # float32 matrices: decode.c reads no F32 layer, the engine dequantizes nothing
    write_gguf(build_hf("llama", tmp_path / "hf"), tmp_path / "hf", f32, "llama", "F32")
    assert quick.open_engine(EngineConfig(model=str(f32), device="cpu")) is None
    seeded = SamplingParams(temperature=0.8, seed=1)
    assert takes(SamplingParams(temperature=0.8)) and takes(seeded.with_(temperature=0))
    assert not takes(seeded) and not takes(GREEDY.with_(n=2)) and not takes(GREEDY.with_(logprobs=1))


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`pagedchat run ...` in a fresh process that reports, after the command, whether torch was imported."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: sys.stderr.write(f\"\\ntorch imported: {'torch' in sys.modules}\\n\"))\n"
            "sys.argv = ['pagedchat', *sys.argv[1:]]\n"
            "from pagedchat.cli import main\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_run_answers_without_torch_and_with_the_engines_reply(gguf_file):
    path = str(gguf_file("gemma3"))
    args = ["run", "-m", path, "--raw", "--temperature", "0", "--max-tokens", "12", "--json", "hello there"]
    quick = _cli(args, {})
    engine = _cli(args, {"PAGEDCHAT_QUICK": "0", "PAGEDCHAT_NATIVE": "always"})
    assert quick.returncode == engine.returncode == 0, quick.stderr + engine.stderr
    assert "torch imported: False" in quick.stderr and "torch imported: True" in engine.stderr
    ours, theirs = json.loads(quick.stdout), json.loads(engine.stdout)
    assert ours["outputs"] == theirs["outputs"] and ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert ours["usage"] == theirs["usage"]


def test_run_streams_a_chat_reply_and_takes_the_engine_for_what_it_does_not_run(gguf_file):
    path = str(gguf_file("llama"))
    chat = _cli(["run", "-m", path, "--temperature", "0", "--max-tokens", "8", "hi"], {})
    assert chat.returncode == 0 and "torch imported: False" in chat.stderr, chat.stderr
    engine = _cli(["run", "-m", path, "--temperature", "0", "--max-tokens", "8", "hi"],
                  {"PAGEDCHAT_QUICK": "0", "PAGEDCHAT_NATIVE": "always"})
    assert chat.stdout == engine.stdout
    for args in (["-n", "2"], ["--temperature", "0.7", "--seed", "3"], ["--quantize", "none"]):
        other = _cli(["run", "-m", path, "--max-tokens", "4", *args, "hi"], {})
        assert other.returncode == 0 and "torch imported: True" in other.stderr, (args, other.stderr)
    long_prompt = " ".join(["word"] * 120)   # past QUICK_PROMPT_MAX tokens (3 each), within the context of 512
    other = _cli(["run", "-m", path, "--max-tokens", "2", "--raw", long_prompt], {})
    assert other.returncode == 0 and "torch imported: True" in other.stderr, other.stderr
