"""--quantize int8: weight-only int8 with per-channel scales, quantized at load from the fp checkpoint.

fp32 stays exact (the equality tests run without it); int8 is checked for staying close to fp32 on the shipped
demo model, whose trained weights are what a user runs (the tests' random models use a large init std on
purpose, the worst case for a quantizer: `pagedchat bench accuracy` measures those, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedchat.bench.int8_accuracy import measure, teacher_forced_logits
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.layers import Linear as PlainLinear
from pagedchat.model.quantize import PACKED_MAX_ROWS, Int8Linear


def _reference(q: Int8Linear, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ (q.weight.float() * q.scales[:, None]).T + linear.bias


@pytest.mark.parametrize("in_features, rows, packed", [(64, 3, True), (64, PACKED_MAX_ROWS + 1, False),
                                                       (72, 3, False)])
def test_int8_linear_is_the_dequantized_matmul(in_features, rows, packed):
    """Few rows take the packed kernel, many rows and widths it cannot take (it returns garbage for
    in_features 72) the dequantized matmul: both are the dequantized weight's product."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 48, bias=True)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (48,) and q.packed == (in_features % 16 == 0)
    dequantized = q.weight.float() * q.scales[:, None]
    assert ((dequantized - linear.weight).abs() <= q.scales[:, None] * 0.5 + 1e-6).all()  # round to nearest
    x = torch.randn(rows, 1, in_features)
    expected = _reference(q, linear, x)
    got = q(x)
    assert got.shape == (rows, 1, 48) and got.dtype == x.dtype
    tol = 1e-2 if packed else 1e-5  # the packed kernel reads bf16 activations
    assert torch.allclose(got, expected, rtol=0, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_in_half_precision(dtype):
    """The dequantized path (other devices, half-precision models) keeps its dtype and its numbers."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    q = Int8Linear(linear)
    x = torch.randn(5, 64)
    expected = x @ (q.weight.float() * q.scales[:, None]).T
    got = q.dequantized_matmul(x.to(dtype))
    assert got.dtype == dtype
    assert torch.allclose(got.float(), expected, rtol=0, atol=2e-2 * expected.abs().max().item())


def test_int8_on_the_demo_model_stays_close_to_fp32(monkeypatch):
    """End to end through the engine: greedy tokens agree with fp32 up to near-ties and no logit moves by more
    than a few percent of the logits' spread (measured 0.8% on 2026-11-24). Every decode step on the native step, as the
    teacher-forced passes run (not the first steps' native-or-torch trials: native/paths.py)."""
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")
    from pagedchat.registry import Registry

    path = str(Registry().resolve("demo").path)
    prompts = [[1, 400, 401, 402, 403, 12, 2], [1, 30, 31, 32, 33, 34, 35, 36, 2], list(range(5, 45))]
    r = measure(path, prompts, tokens=12)
    # every prompt identical, or diverging only where fp32's top two logits are within the error (a near-tie)
    assert r["identical_prompts"] >= 2 and r["identical_prompts"] + r["divergences_at_near_ties"] == r["prompts"], r
    assert 0 < r["max_logit_error_rel_spread"] < 0.03, r


def test_teacher_forced_logits_are_the_engines(model_dirs, monkeypatch):
    """The accuracy measurement forces the model the way the engine runs it: fp32 forced logits pick
    exactly the fp32 engine's greedy tokens (every decode step on the native step, as the forced passes)."""
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")
    path, _ = model_dirs["llama"]
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, enable_prefix_cache=False),
                    show_progress=False)
    prompt = list(range(5, 30))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = engine.generate([prompt], params)[0].outputs[0].token_ids
    assert teacher_forced_logits(engine, prompt, tokens).argmax(dim=-1).tolist() == tokens


def test_quantized_engine_replaces_every_linear(model_dirs):
    path, _ = model_dirs["qwen2"]  # tied embeddings: the LM head is quantized apart from the embedding
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, quantize="int8"), show_progress=False)
    model = engine.runner.model
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed_tokens.weight.dtype == torch.float32
    out = engine.generate([list(range(5, 40))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_every_model_command_takes_quantize(typer_cli, command):
    result = typer_cli(command, "--help")
    assert result.exit_code == 0 and "--quantize" in result.output


def test_quantize_from_the_flag_and_models_toml(model, pagedchat_cli, xdg_home):
    from pagedchat.settings import ModelOptions, load_engine

    code, out, err = pagedchat_cli("run", "-m", str(model), "--raw", "--quantize", "int8", "--max-tokens", "4", "hi")
    assert code == 0 and out, err
    code, _, err = pagedchat_cli("run", "-m", str(model), "--raw", "--quantize", "int3", "hi")
    assert code != 0 and err.strip().splitlines() == [
        "pagedchat: error: --quantize must be int8, int4 or none, got 'int3'"]
    config = xdg_home / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "models.toml").write_text(f'[models.q]\npath = "{model}"\nquantize = "int8"\n')
    engine, _ = load_engine(ModelOptions(model="q"), show_progress=False)
    assert any(isinstance(m, Int8Linear) for m in engine.runner.model.modules())
    engine, _ = load_engine(ModelOptions(model="q", quantize="none"), show_progress=False)  # the flag wins
    assert not any(isinstance(m, Int8Linear) for m in engine.runner.model.modules())
    (config / "models.toml").write_text(f'[models.q]\npath = "{model}"\nquantize = "int3"\n')
    code, _, err = pagedchat_cli("run", "-m", "q", "--raw", "hi")
    assert code != 0 and "quantize must be int8, int4 or none, got 'int3'" in err and "Traceback" not in err


@pytest.mark.parametrize("arch", ["phi3", "qwen3_moe", "mixtral", "gemma2", "gemma3"])
def test_int8_runs_on_every_family(model_dirs, arch):
    """Every family's linear layers go int8; an MoE router stays fp (its experts are not nn.Linear)."""
    from pagedchat.model.moe import SparseMoE

    engine = Engine(EngineConfig(model=str(model_dirs[arch][0]), device="cpu", num_blocks=128, quantize="int8"),
                    show_progress=False)
    model = engine.runner.model
    routers = [m.gate for m in model.modules() if isinstance(m, SparseMoE)]
    assert all(type(r) in (nn.Linear, PlainLinear) for r in routers) and (routers or arch not in ("qwen3_moe", "mixtral"))
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > len(routers)
    assert not any(type(m) not in (nn.Linear, PlainLinear) and isinstance(m, nn.Linear) for m in model.modules())
    out = engine.generate([list(range(5, 30))], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_quantize_is_refused_with_a_server(pagedchat_cli):
    """--server: the server's weights are its own; the flag says so instead of being ignored."""
    code, _, err = pagedchat_cli("run", "--server", "http://127.0.0.1:9", "--quantize", "int8", "hi")
    assert code == 2 and err.strip().splitlines() == [
        "pagedchat: error: --quantize quantizes the local engine's weights: not available with --server"]


@pytest.mark.parametrize("flag", [["--device", "cpu"], ["--speculate", "ngram"], ["--kv-memory", "64MiB"],
                                  ["--draft-model", "demo"], ["--kv-disk", "0"]])
def test_local_engine_flags_are_refused_with_a_server(pagedchat_cli, flag):
    """Flags that set up the local engine would do nothing with a server generating: one line, exit 2."""
    code, _, err = pagedchat_cli("run", "--server", "http://127.0.0.1:9", *flag, "hi")
    assert code == 2 and err.strip().splitlines() == [
        f"pagedchat: error: {flag[0]} sets up the local engine: not available with --server (the server's own "
        "settings decide)"]
