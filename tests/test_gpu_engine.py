"""End to end on CUDA (skipped without a GPU): Triton kernels + CUDA graphs against transformers on the same GPU.

  - every family, fp32: short prompts against the CPU reference with graphs on and off; a batch of 4 prompts up
    to ~1,600 tokens through a 64-token step budget, the same batch again from the prefix cache, and n=4 on the
    longest, against transformers on the GPU (a divergence says where, the tokens, the top-2 gap and what a
    float64 run picks: tests/gpu_oracle.py); a Qwen2 shape with 7 query = 7 KV heads of 32 among them;
  - bf16: the first token agrees with an fp32 reference at least as often as transformers' own bf16 does;
  - every family's decode step is captured in CUDA graphs (no eager fallback);
  - Engine.close() gives the device memory back, also when a second model follows the first.
"""

import logging
import random

import pytest
import torch

from gpu_oracle import cuda_reference, divergence
from hf_models import ARCHS, NEW_FAMILIES, build_model
from oracle import assert_greedy_equal, reference
from test_engine_equality import prompts
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.runner import release_device_memory

pytestmark = pytest.mark.gpu

FAMILIES = ARCHS + NEW_FAMILIES
# The shape that once diverged on a GPU: MHA with an odd head count (7 query = 7 KV heads, head_dim 32), qkv bias,
# tied embeddings.
QWEN2_MHA7 = dict(hidden_size=224, num_attention_heads=7, num_key_value_heads=7, tie_word_embeddings=True)
LONG_FAMILIES = FAMILIES + ("qwen2-mha7",)
LONG_CONTEXT = 2048
NEW_TOKENS = 64
MiB = 2**20


def _long_overrides(arch: str) -> dict:
    """Test configs with room for ~1,600-token prompts (Phi-3's longrope keeps its short factors throughout:
    transformers re-encodes with the long ones past the original context, pagedchat does not)."""
    over = {"max_position_embeddings": LONG_CONTEXT + 2 * NEW_TOKENS}
    if arch == "phi3":
        from hf_models import make_config

        rope = dict(make_config("phi3").rope_parameters, original_max_position_embeddings=over["max_position_embeddings"])
        over.update(rope_parameters=rope, original_max_position_embeddings=over["max_position_embeddings"])
    return {**QWEN2_MHA7, **over} if arch == "qwen2-mha7" else over


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-models")
    cache = {}

    def get(arch):
        if arch not in cache:
            family = "qwen2" if arch == "qwen2-mha7" else arch
            cache[arch] = (root / arch, build_model(family, root / arch, **_long_overrides(arch)))
        return cache[arch]
    return get


def _long_prompts(seed: int = 27) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (1601, 1234, 777, 95)]


def _check(hf, batch, outs) -> list[str]:
    problems = []
    for prompt, out in zip(batch, outs):
        ref_tokens, ref_logits = cuda_reference(hf, prompt, NEW_TOKENS)
        for variant in out.outputs:
            problem = divergence(hf, prompt, variant.token_ids, ref_tokens, ref_logits)
            if problem:
                problems.append(problem)
    return problems


def _long_engine(path, **config) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=1024,
                               max_num_batched_tokens=64, max_num_seqs=8, **config), show_progress=False)


# What a divergence is rerun without, one component at a time, so one GPU run names the part at fault.
SUSPECTS = {"CUDA graphs off": (dict(cuda_graphs=False), {}, None),
            "fused layer kernels off": (dict(fused_kernels=False), {}, None),
            "attention v1 kernels": ({}, {"PAGEDCHAT_ATTN": "v1"}, None),
            "attention on the torch twins": (dict(cuda_graphs=False), {}, "torch")}


def _bisect(path, hf, batch, greedy, monkeypatch) -> list[str]:
    """The same batch once per suspect turned off: which configurations are exact."""
    lines = []
    for name, (config, env, attention) in SUSPECTS.items():
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            engine = _long_engine(path, **config)
            if attention:
                for layer in engine.runner.attention_layers:
                    layer.backend = attention
            problems = _check(hf, batch, engine.generate(batch, greedy))
            engine.close()
        lines.append(f"  {name}: " + (f"{len(problems)} divergent, first {problems[0]}" if problems else "exact"))
    return lines


@pytest.mark.parametrize("arch", LONG_FAMILIES)
def test_long_prompts_chunked_cached_and_forked_match_transformers_on_the_gpu(long_models, arch, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = long_models(arch)
    engine = _long_engine(path)
    assert engine.runner.graphs is not None
    batch, greedy = _long_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    problems = [f"batch: {p}" for p in _check(hf, batch, engine.generate(batch, greedy))]
    again = engine.generate(batch, greedy)
    assert all(out.prefix_hit_tokens > 0 for out in again[:3])
    problems += [f"from the prefix cache: {p}" for p in _check(hf, batch, again)]
    forks = engine.generate(batch[:1], greedy.with_(n=4))
    problems += [f"n=4: {p}" for p in _check(hf, batch[:1], forks)]
    engine.check_invariants()
    engine.close()
    if problems:
        problems += ["the batch again with one component off:", *_bisect(path, hf, batch, greedy, monkeypatch)]
    assert not problems, f"{arch}:\n" + "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_fp32_greedy_matches_transformers(model_dirs, arch, graphs):
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=512,
                                 cuda_graphs=graphs, max_num_seqs=32), show_progress=False)
    assert (engine.runner.graphs is not None) == graphs
    batch = prompts(12, seed=21, lo=3, hi=90)
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(batch, outs):
        ref_tokens, ref_logits = reference(hf, prompt, 20)
        assert_greedy_equal(out.outputs[0].token_ids, ref_tokens, ref_logits)
    engine.check_invariants()


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_decodes_through_cuda_graphs(model_dirs, arch, caplog):
    caplog.set_level(logging.WARNING, logger="pagedchat.engine")
    engine = Engine(EngineConfig(model=str(model_dirs[arch][0]), device="cuda", dtype="float32", num_blocks=256,
                                 max_num_seqs=16), show_progress=False)
    assert engine.runner.graphs is not None, caplog.text
    assert "CUDA graph capture failed" not in caplog.text
    batch = prompts(3, seed=5, lo=20, hi=60)
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    problems = [p for p in (divergence(model_dirs[arch][1], prompt, out.outputs[0].token_ids,
                                       *cuda_reference(model_dirs[arch][1], prompt, 24))
                            for prompt, out in zip(batch, outs)) if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma3"])
def test_bf16_first_tokens_agree_with_fp32_as_often_as_transformers_bf16(model_dirs, arch):
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", num_blocks=256), show_progress=False)
    batch = prompts(24, seed=9, lo=8, hi=120)
    ours = [o.outputs[0].token_ids[0] for o in engine.generate(batch, SamplingParams(temperature=0, max_tokens=1))]
    fp32 = [cuda_reference(hf, p, 1)[0][0] for p in batch]
    theirs = [cuda_reference(hf, p, 1, torch.bfloat16)[0][0] for p in batch]
    agree = sum(a == b for a, b in zip(ours, fp32))
    assert agree >= sum(a == b for a, b in zip(theirs, fp32)) - 1, (agree, len(batch))


def test_cuda_bf16_default_runs_and_pool_is_sized_from_free_memory(model_dirs):
    path, _ = model_dirs["qwen3"]
    engine = Engine(EngineConfig(model=str(path), device="cuda", kv_fraction=0.2), show_progress=False)
    assert engine.loaded.dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert engine.pool.num_blocks * engine.runner.bytes_per_block <= 0.2 * total
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    engine.close()


def _use_and_close(path) -> None:
    """An engine as `run` or the REPL builds one (pool sized from free memory, graphs on), used, closed."""
    engine = Engine(EngineConfig(model=str(path), device="cuda", kv_fraction=0.3), show_progress=False)
    engine.generate([[5, 6, 7, 8] * 40, [9, 10]], SamplingParams(temperature=0, max_tokens=16, n=2), keep=True)
    assert engine.runner.graphs is not None
    engine.close()
    del engine


def test_close_gives_the_device_memory_back_also_when_another_model_follows(model_dirs):
    release_device_memory(torch.device("cuda"))
    before = torch.cuda.memory_reserved()
    _use_and_close(model_dirs["qwen3_moe"][0])
    after_first = torch.cuda.memory_reserved()
    _use_and_close(model_dirs["gemma3"][0])     # a second model in the same process, as a model switch makes
    after_second = torch.cuda.memory_reserved()
    assert after_first - before <= 4 * MiB, f"{(after_first - before) / MiB:.1f} MiB still reserved after close()"
    assert after_second - before <= 4 * MiB, f"{(after_second - before) / MiB:.1f} MiB still reserved after close()"
