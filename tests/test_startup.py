"""One-shot start-up without transformers: config.json and the tokenizer read directly must agree with
transformers (the oracle), the run path must not import it, and the pool needs no zero-fill."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import ARCHS, CHATML, build_tokenizer, make_config
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.hf_config import read_config
from pagedchat.model.llama import ArchSpec
from pagedchat.model.loader import load_config
from pagedchat.model.tokenizer import FastTokenizer, load_fast_tokenizer

DEMO = Path(__file__).parents[1] / "pagedchat" / "assets" / "demo-chat"

# Templates written the way Hub templates are: trimmed blocks, loop controls, tojson, raise_exception,
# namespace, the generation block, reasoning under another name, special-token variables.
TEMPLATES = {
    "chatml": CHATML,
    "hub_style": (
        "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
        "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}\n"
        "<|im_start|>system\n{{ system }}{% if tools %} tools: {{ tools | tojson }}{% endif %}<|im_end|>\n"
        "{%- set ns = namespace(n=0) %}\n"
        "{% for m in messages %}\n"
        "  {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "  {%- if loop.index > 50 %}{% break %}{% endif %}\n"
        "  {%- set ns.n = ns.n + 1 %}\n"
        "<|im_start|>{{ m['role'] }}\n"
        "  {%- if m['role'] == 'assistant' %}{% generation %}{% if m.reasoning_content %}<think>"
        "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}{% endgeneration %}"
        "  {%- else %}{{ m['content'] | trim }}{% endif %}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ '#' ~ ns.n if extra else '' }}"),
}
CHATS = [
    [{"role": "user", "content": "hello world, how are you today?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": " what is 17 + 25? "},
     {"role": "assistant", "content": "it is 42.", "thinking": "add them"},
     {"role": "user", "content": "héllo ünïcode ✓ <|im_start|>"}],
]
TEXTS = ["the quick brown fox", " leading space and  double", "<|im_start|>user\nhi<|im_end|>", "ünï ✓ 🦊", ""]


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_ids(tok, *args, **kwargs) -> list[int]:
    ids = tok.apply_chat_template(*args, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    build_tokenizer(root / "test")
    shutil.copytree(DEMO, root / "demo")
    return {"test": root / "test", "demo": root / "demo"}


@pytest.mark.parametrize("which", ["test", "demo"])
def test_fast_tokenizer_encodes_and_decodes_like_transformers(tokenizer_dirs, which):
    ours, theirs = load_fast_tokenizer(tokenizer_dirs[which]), _hf_tokenizer(tokenizer_dirs[which])
    assert isinstance(ours, FastTokenizer)
    assert len(ours) == len(theirs) and ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id and ours.pad_token_id == theirs.pad_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special).input_ids
            assert ids == list(theirs(text, add_special_tokens=special).input_ids)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("which", ["test", "demo"])
@pytest.mark.parametrize("template", [None, *TEMPLATES])
def test_chat_template_renders_like_transformers(tokenizer_dirs, which, template):
    ours, theirs = load_fast_tokenizer(tokenizer_dirs[which]), _hf_tokenizer(tokenizer_dirs[which])
    if template is not None:
        ours.chat_template = theirs.chat_template = TEMPLATES[template]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "ünï"}}}]
    for chat in CHATS:
        for gen in (True, False):
            for kwargs in ({}, {"tools": tools, "extra": True}):
                text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False, **kwargs)
                assert text == theirs.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False, **kwargs)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, **kwargs) == \
                    _hf_ids(theirs, chat, add_generation_prompt=gen, **kwargs)


def test_template_errors_surface_as_jinja_errors(tokenizer_dirs):
    import jinja2

    tok = load_fast_tokenizer(tokenizer_dirs["test"])
    tok.chat_template = TEMPLATES["hub_style"]
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_folders_it_cannot_reproduce_go_to_transformers(tokenizer_dirs, tmp_path):
    shutil.copytree(tokenizer_dirs["test"], tmp_path / "t")
    config = tmp_path / "t" / "tokenizer_config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "tokenizer_class": "LlamaTokenizer", "add_bos_token": True}))
    assert load_fast_tokenizer(tmp_path / "t") is None
    assert load_fast_tokenizer(tmp_path) is None  # no tokenizer.json


@pytest.mark.parametrize("arch", ARCHS)
def test_config_read_directly_matches_autoconfig(tmp_path, arch):
    from transformers import AutoConfig

    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}} if arch == "llama" else {}
    config = make_config(arch, **overrides)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    light = read_config(tmp_path / "config.json")
    assert light is not None
    auto = AutoConfig.from_pretrained(tmp_path)
    assert ArchSpec.from_hf(light) == ArchSpec.from_hf(auto)
    from pagedchat.model.layers import rope_inv_freq

    assert torch.equal(rope_inv_freq(light, 16)[0], rope_inv_freq(auto, 16)[0])
    assert getattr(light, "sliding_window", None) == getattr(auto, "sliding_window", None)


def test_config_defaults_match_transformers_when_fields_are_missing(tmp_path):
    """A minimal config.json (older exports leave fields out) gets transformers' class defaults."""
    from transformers import AutoConfig

    for arch, model_type in (("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                             ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")):
        (tmp_path / "config.json").write_text(json.dumps({
            "architectures": [arch], "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
        assert ArchSpec.from_hf(read_config(tmp_path / "config.json")) == \
            ArchSpec.from_hf(AutoConfig.from_pretrained(tmp_path))
        auto = AutoConfig.from_pretrained(tmp_path)
        assert getattr(read_config(tmp_path / "config.json"), "sliding_window", None) == \
            getattr(auto, "sliding_window", None)


def test_scaled_rope_and_remote_code_configs_use_autoconfig(model_dirs):
    path = model_dirs["llama"][0]  # llama3 rope scaling
    assert read_config(path / "config.json") is None
    assert type(load_config(path)).__module__.startswith("transformers")


@pytest.mark.parametrize("arch", [None, "gemma3", "qwen3_moe"])
def test_run_imports_neither_transformers_nor_the_compiler_stack(tmp_path, arch):
    """The one-shot path: what costs seconds to import (transformers, torch._dynamo, sympy) or is GPU-only
    (triton) stays out of the process; also for GGUF files of the families whose modules are built apart from
    Llama's (a layer's random init on the meta device imports torch._dynamo)."""
    model = []
    if arch:
        from gguf_models import build_hf, write_gguf

        path = tmp_path / f"{arch}.gguf"
        write_gguf(build_hf(arch, tmp_path / "hf"), tmp_path / "hf", path, arch)
        model = ['-m', str(path), '--raw']
    script = ("import sys\nfrom pagedchat.cli import main\n"
              f"sys.argv = ['pagedchat', 'run', *{model!r}, '--max-tokens', '3', '--threads', '1', 'What is 17 + 25?']\n"
              "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
              "heavy = [m for m in ('transformers', 'torch._dynamo', 'sympy', 'triton') if m in sys.modules]\n"
              "print('HEAVY', heavy)\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "c"), "XDG_DATA_HOME": str(tmp_path / "d")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_pool_memory_is_never_read_before_written(model_dirs, arch):
    """The pool is allocated without zero-fill: poison every slot with NaN and the tokens still equal
    transformers', alone and batched (padding slots of shorter sequences are masked, not zero)."""
    import random

    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), num_blocks=64), show_progress=False)
    for cache in engine.runner.k_caches + engine.runner.v_caches:
        cache.fill_(math.nan)
    rng = random.Random(3)
    batch = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=12)
    for prompts in ([batch[0]], batch):
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 12))


def test_default_cpu_pool_holds_what_the_model_can_use(model):
    engine = Engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=4), show_progress=False)
    assert engine.runner.num_blocks == 4 * math.ceil(engine.loaded.max_model_len / 16)
    explicit = Engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=4, kv_memory="64MiB"),
                      show_progress=False)
    assert explicit.runner.num_blocks == 64 * 1024**2 // explicit.runner.bytes_per_block
