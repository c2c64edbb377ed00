"""--kv-dtype int8 end to end on the tests' tiny models.

The oracle is transformers with its KV cache quantized the same way (oracle.quantized_kv_cache: each new
token's K and V stored as int8 + a float16 scale per head, read back as values x scales): the int8 pool's
greedy tokens must equal it, alone, batched, chunked, preempted, forked, in beams, speculating, on Gemma's
sliding windows. (Against the unquantized model, random-weight models drift apart after a few dozen tokens:
`pagedchat bench accuracy --modes fp,kv-int8` reports that agreement; docs/benchmarks.md.) Then the pool's size in bytes, the RAM
and disk tiers (a quantized block comes back byte for byte, and is never read as another KV dtype), and the
options."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from beam_oracle import assert_beams_equal, beam_reference
from oracle import assert_greedy_equal, quantized_kv_cache, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams

TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)


@pytest.fixture(autouse=True)
def torch_path_only(monkeypatch):
    """Every step on the torch path. Why: which path a step takes is measured (native/paths.py), so it depends
    on timing, and the two paths sum in different orders; through an int8 pool a last-bit difference in a K or
    V value can round to the next int8 step and move later logits by ~1e-3, past the oracle's near-tie. The
    native step's int8 pool is held to its torch twin in test_native_decode.py."""
    from pagedchat.native import build

    monkeypatch.setenv("PAGEDCHAT_NATIVE", "0")
    monkeypatch.setattr(build, "_loaded", None)
_REFERENCES: dict = {}


def prompts(n, seed, lo=9, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


PROMPTS = prompts(4, seed=21)


def int8_reference(model_dirs, arch, prompt, tokens=TOKENS):
    key = (arch, tuple(prompt), tokens)
    if key not in _REFERENCES:
        with quantized_kv_cache(torch.int8):
            _REFERENCES[key] = reference(model_dirs[arch][1], prompt, tokens)
    return _REFERENCES[key]


def int8_engine(model_dirs, arch, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dirs[arch][0]), kv_dtype="int8", **{"num_blocks": 256, **kw}),
                  show_progress=False)


def check(engine, model_dirs, arch, batch, n=1):
    for prompt, out in zip(batch, engine.generate(batch, GREEDY.with_(n=n))):
        assert len(out.outputs) == n
        for variant in out.outputs:
            assert_greedy_equal(variant.token_ids, *int8_reference(model_dirs, arch, prompt))
    engine.check_invariants()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_int8_pool_equals_transformers_over_the_same_quantized_cache(model_dirs, arch):
    engine = int8_engine(model_dirs, arch)
    assert engine.runner.k_caches[0].dtype == torch.int8 and engine.runner.kv.k_scales[0].dtype == torch.float16
    check(engine, model_dirs, arch, PROMPTS[:1])
    check(int8_engine(model_dirs, arch, max_num_batched_tokens=9), model_dirs, arch, PROMPTS[:2])


def test_int8_pool_preempted_forked_and_in_beams(model_dirs):
    """Preemption in a small pool; n = 3 greedy variants sharing the prompt's partial last block (each
    copies it, scales with values, before writing); beam search, whose beams fork and drop every step."""
    small = int8_engine(model_dirs, "llama", num_blocks=12, block_size=8)
    check(small, model_dirs, "llama", PROMPTS)
    assert small.scheduler.num_preemptions > 0
    engine = int8_engine(model_dirs, "llama", block_size=8)
    prompt = next(p for p in PROMPTS if len(p) % 8)
    check(engine, model_dirs, "llama", [prompt], n=3)
    assert engine.pool.cow_copies >= 2
    params = SamplingParams(beam_width=3, max_tokens=12)
    out = engine.generate([prompt], params)[0].outputs
    with quantized_kv_cache(torch.int8):
        assert_beams_equal(out, beam_reference(model_dirs["llama"][1], prompt, 3, 12))
    assert engine.pool.num_used == 0


def test_int8_pool_speculating_with_ngrams_and_a_draft_model_in_the_pool(model_dirs):
    """Rejected drafts leave quantized K/V behind that later tokens overwrite (with their own scales); a
    draft model's KV is quantized in the same pool, and when the target drafts for itself nearly every draft
    is accepted (its int8 KV is right)."""
    from test_speculative import repetitive_prompts

    batch = repetitive_prompts(3, seed=2)
    engine = int8_engine(model_dirs, "qwen2", speculate="ngram")
    check(engine, model_dirs, "qwen2", batch)
    assert engine.speculator.stats.proposed_tokens > engine.speculator.stats.accepted_tokens  # rolled back
    engine = int8_engine(model_dirs, "llama", draft_model=str(model_dirs["llama"][0]))
    draft = engine.speculator.proposer.runner
    assert draft.k_caches[0].dtype == torch.int8 and draft.num_blocks == engine.pool.num_blocks
    check(engine, model_dirs, "llama", batch)
    stats = engine.speculator.stats
    assert stats.accepted_tokens >= 0.95 * stats.proposed_tokens > 0, stats


def test_int8_pool_never_reads_a_slot_before_it_is_written(model_dirs):
    """The quantized pool is not zero-filled either: random bytes in every value and NaN in every scale, and
    the tokens stay the oracle's, alone and batched."""
    engine = int8_engine(model_dirs, "qwen3", num_blocks=64)
    kv = engine.runner.kv
    for values in kv.k_caches + kv.v_caches:
        values.random_(-128, 128)
    for scales in kv.k_scales + kv.v_scales:
        scales.fill_(float("nan"))
    check(engine, model_dirs, "qwen3", PROMPTS[:1])
    check(engine, model_dirs, "qwen3", PROMPTS[1:4])


def test_the_same_kv_memory_holds_the_bytes_of_int8_values_and_their_scales(model_dirs):
    """--kv-memory stays bytes: a block costs 2 x layers x block_size x kv heads x (head_dim + 2) bytes in int8
    (one float16 scale per token and head) against head_dim x 4 in fp32; a draft model's KV is counted in its
    KV dtype too."""
    path = str(model_dirs["llama"][0])
    budget = 4 * 1024**2
    engines = {kv: Engine(EngineConfig(model=path, kv_dtype=kv, kv_memory=budget), show_progress=False)
               for kv in ("auto", "int8")}
    spec = engines["auto"].loaded.spec
    per_head = {"auto": spec.head_dim * 4, "int8": spec.head_dim + 2}
    for kv, engine in engines.items():
        bytes_per_block = 2 * spec.num_layers * 16 * spec.num_kv_heads * per_head[kv]
        assert engine.runner.bytes_per_block == bytes_per_block
        assert engine.runner.num_blocks == budget // bytes_per_block
        allocated = sum(t.nbytes for t in engine.runner.kv._tensors())
        assert allocated == engine.runner.num_blocks * bytes_per_block <= budget
    assert engines["int8"].pool_stats().kv_dtype == "int8" and engines["auto"].pool_stats().kv_dtype == "float32"
    with_draft = Engine(EngineConfig(model=path, kv_dtype="int8", kv_memory=budget, draft_model=path),
                        show_progress=False)
    assert with_draft.runner.num_blocks == budget // (2 * engines["int8"].runner.bytes_per_block)


def _tiered(model_dirs, tmp_path, kv_dtype, **kw):
    return Engine(EngineConfig(model=str(model_dirs["llama"][0]), kv_dtype=kv_dtype, block_size=8,
                               kv_ram="1MiB", kv_disk="8MiB", kv_dir=str(tmp_path), **{"num_blocks": 64, **kw}),
                  show_progress=False)


def _reply(engine, prompt):
    """A greedy reply to `prompt`, pinned, and the bytes of its prompt's blocks that came from a cache."""
    out = engine.generate([prompt], GREEDY, keep=True)[0]
    hit_blocks = out.outputs[0].handle.sequence.block_table[:out.prefix_hit_tokens // engine.pool.block_size]
    return out.outputs[0], engine.runner.read_blocks(hit_blocks) if hit_blocks else None


def test_quantized_blocks_come_back_from_ram_and_disk_byte_for_byte(model_dirs, tmp_path):
    prompt = PROMPTS[3] + PROMPTS[2]
    first = _tiered(model_dirs, tmp_path, "int8", num_blocks=16)
    reply, _ = _reply(first, prompt)
    assert_greedy_equal(reply.token_ids, *int8_reference(model_dirs, "llama", prompt))
    full = first.runner.read_blocks(reply.handle.sequence.block_table[:len(prompt) // 8])
    assert full.dtype == torch.uint8 and full.shape[1] == first.runner.bytes_per_block
    first.release(reply.handle)
    first.generate(PROMPTS[:3], GREEDY)          # they take the released blocks: evicted to the RAM tier
    reply, reloaded = _reply(first, prompt)
    assert first.pool.ram_hit_tokens > 0 and torch.equal(reloaded, full[:len(reloaded)])
    assert_greedy_equal(reply.token_ids, *int8_reference(model_dirs, "llama", prompt))
    first.close()
    second = _tiered(model_dirs, tmp_path, "int8")   # another process: the disk tier
    reply, reloaded = _reply(second, prompt)
    assert second.pool.disk_hit_tokens > 0 and torch.equal(reloaded, full[:len(reloaded)])
    assert_greedy_equal(reply.token_ids, *int8_reference(model_dirs, "llama", prompt))


def test_a_quantized_block_is_never_read_as_another_kv_dtype(model_dirs, tmp_path):
    """The fingerprint names the KV dtype: an fp32 pool finds nothing of an int8 pool's blocks, and int8 files
    moved into the fp32 folder are refused (foreign fingerprint, other payload) and removed."""
    from pagedchat.engine.kv.disk import block_files
    from pagedchat.engine.kv.fingerprint import engine_fingerprint
    from pagedchat.model.loader import weight_files

    path = model_dirs["llama"][0]
    names = {kv: engine_fingerprint(path, weight_files(path), torch.float32, 8, "cpu", tmp_path, kv_dtype=kv)[0]
             for kv in ("int8", "fp8", None)}
    assert len(set(names.values())) == 3
    assert names[None] == engine_fingerprint(path, weight_files(path), torch.float32, 8, "cpu", tmp_path,
                                             kv_dtype="float32")[0], "the auto pool's blocks keep their name"
    prompt = PROMPTS[3] + PROMPTS[2]
    quantized = _tiered(model_dirs, tmp_path, "int8")
    _reply(quantized, prompt)
    quantized.close()
    plain = _tiered(model_dirs, tmp_path, "auto")
    plain.generate([prompt], GREEDY)
    assert plain.pool.disk_hit_tokens == 0
    plain.close()
    int8_folder, fp32_folder = tmp_path / names["int8"], tmp_path / names[None]
    shutil.rmtree(fp32_folder)
    shutil.copytree(int8_folder, fp32_folder)   # meta.json is rewritten by the next engine; the blocks stay
    moved = len(list(block_files(fp32_folder)))
    assert moved > 0
    plain = _tiered(model_dirs, tmp_path, "auto")
    tokens = plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert plain.pool.disk_hit_tokens == 0 and plain.tiers.disk.removed > 0
    assert_greedy_equal(tokens, *reference(model_dirs["llama"][1], prompt, TOKENS))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_cuda_quantized_pool_equals_transformers_over_the_same_quantized_cache(model_dirs, kv_dtype):
    """On a GPU (skipped without one): fp32 weights, an int8 or fp8 pool (the torch twins until the Triton
    kernels read quantized caches), against transformers on the CPU with the same quantized cache; and a
    bf16 model's fp8 pool holds about twice the tokens of its bf16 pool in the same memory."""
    from pagedchat.kernels.kv_quant import KV_DTYPES

    path, hf = model_dirs["llama"]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=512, kv_dtype=kv_dtype),
                    show_progress=False)
    assert engine.runner.kv.dtype == KV_DTYPES[kv_dtype] and engine.runner.kv.k_caches[0].is_cuda
    outs = engine.generate(PROMPTS, GREEDY)
    with quantized_kv_cache(KV_DTYPES[kv_dtype]):
        for prompt, out in zip(PROMPTS, outs):
            assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, TOKENS))
    engine.check_invariants()
    sizes = {kv: Engine(EngineConfig(model=str(path), device="cuda", kv_dtype=kv, kv_memory="64MiB"),
                        show_progress=False).runner.num_blocks for kv in ("auto", kv_dtype)}
    assert sizes[kv_dtype] >= 1.75 * sizes["auto"]   # head dim 16 here: 2 x 16 / (16 + 2) = 1.78


# -- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_every_model_command_takes_kv_dtype(typer_cli, command):
    result = typer_cli(command, "--help")
    assert result.exit_code == 0 and "--kv-dtype" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp8 KV runs on a GPU")
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_fp8_on_a_cpu_is_one_line_before_the_weights_load(model, pagedchat_cli, monkeypatch, device):
    import pagedchat.engine.engine as engine_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the KV dtype was checked")

    monkeypatch.setattr(engine_module, "load_model", no_loading)
    code, _, err = pagedchat_cli("run", "-m", str(model), "--device", device, "--kv-dtype", "fp8", "hi")
    assert code == 2 and err.strip().splitlines() == [
        "pagedchat: error: --kv-dtype fp8 runs on CUDA only; on CPU use auto or int8"]


def test_kv_dtype_from_the_flag_and_models_toml(model, pagedchat_cli, typer_cli, xdg_home):
    code, out, err = pagedchat_cli("run", "-m", str(model), "--raw", "--kv-dtype", "int8", "--json", "--max-tokens",
                                   "4", "hi")
    assert code == 0 and json.loads(out)["kv"]["kv_dtype"] == "int8", err
    code, _, err = pagedchat_cli("run", "-m", str(model), "--kv-dtype", "int4", "hi")
    assert code == 2 and err.strip().splitlines() == [
        "pagedchat: error: --kv-dtype must be one of auto, int8, fp8, got 'int4'"]
    config = xdg_home / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "models.toml").write_text(f'[models.q]\npath = "{model}"\nkv_dtype = "int8"\n')
    shown = json.loads(typer_cli("models", "show", "q", "--json").output)
    assert {s["key"]: s["value"] for s in shown["settings"]}["kv_dtype"] == "int8"
    code, out, err = pagedchat_cli("run", "-m", "q", "--raw", "--json", "--max-tokens", "4", "hi")
    assert code == 0 and json.loads(out)["kv"]["kv_dtype"] == "int8", err
    code, out, err = pagedchat_cli("run", "-m", "q", "--kv-dtype", "auto", "--raw", "--json", "--max-tokens", "4", "hi")
    assert code == 0 and json.loads(out)["kv"]["kv_dtype"] == "float32", err   # the flag wins
    (config / "models.toml").write_text(f'[models.q]\npath = "{model}"\nkv_dtype = "fp16"\n')
    code, _, err = pagedchat_cli("run", "-m", "q", "--raw", "hi")
    assert code != 0 and "kv_dtype must be one of auto, int8, fp8, got 'fp16'" in err and "Traceback" not in err
