"""Tiny random-init HF models of every supported architecture, saved as real HF folders for the tests.

A larger init std than usual keeps the logits peaked, so greedy decoding rarely meets a near-tie.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
NEW_FAMILIES = ("phi3", "qwen3_moe", "mixtral", "gemma2", "gemma3")  # tests/test_model_families.py

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
           "paged attention keeps every branch in one pool", "what is 17 + 25? it is 42.",
           "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9"] * 4


def build_tokenizer(path: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_config(arch: str, vocab_size: int = 320, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=2, bos_token_id=None, pad_token_id=0)
    if arch == "llama":
        cfg = LlamaConfig(**{**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
                                                            "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 64},
                             **overrides})
    elif arch == "mistral":
        cfg = MistralConfig(**{**common, "num_key_value_heads": 1, "sliding_window": None, **overrides})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 32, "num_attention_heads": 4, **overrides})
    else:
        cfg = _new_family_config(arch, common, overrides)
    return cfg


def _new_family_config(arch: str, common: dict, overrides: dict):
    """Phi-3 with partial longrope; Qwen3-MoE with a dense layer among sparse ones; Mixtral; Gemma 2/3 with
    windows small enough that the test prompts cross them."""
    from transformers import Gemma2Config, Gemma3TextConfig, MixtralConfig, Phi3Config, Qwen3MoeConfig

    if arch == "phi3":
        rotary_half = int(16 * 0.75) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 256, "factor": 2.0,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)]}
        return Phi3Config(**{**common, "rope_parameters": rope, "original_max_position_embeddings": 256, **overrides})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, "head_dim": 32, "num_hidden_layers": 3, "moe_intermediate_size": 48,
                                 "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                 "mlp_only_layers": [1], **overrides})
    if arch == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 48, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "sliding_window": None, **overrides})
    gemma = dict(common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24, tie_word_embeddings=True,
                 hidden_activation="gelu_pytorch_tanh")
    if arch == "gemma2":
        return Gemma2Config(**{**gemma, "num_hidden_layers": 4, "attn_logit_softcapping": 5.0,
                               "final_logit_softcapping": 8.0, **overrides})
    if arch == "gemma3":
        layer_types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
        return Gemma3TextConfig(**{**gemma, "num_hidden_layers": 6, "layer_types": layer_types,
                                   "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 100000.0},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}},
                                   **overrides})
    raise ValueError(arch)


def _liven_gemma(model) -> None:
    """Gemma's norms start at zero (a scale of 1) and its embeddings are multiplied by sqrt(hidden): a random
    model then just repeats its input token. Random norm scales and small embeddings make every layer count."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 1.0)
        model.get_input_embeddings().weight.mul_(0.1)


def build_model(arch: str, path: Path, seed: int = 0, with_tokenizer: bool = True, **overrides):
    """Save a random model (and tokenizer) to `path`; return the HF model in fp32 eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        build_tokenizer(path)
    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch.startswith("gemma"):
        _liven_gemma(model)
    model.save_pretrained(path)
    return model


def build_gemma3_vision_language(path: Path, seed: int = 0):
    """A Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration, the layout of Gemma 3 from 4B
    up) whose text model is the gemma3 test config, with a one-layer image tower pagedchat does not load."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=make_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=317, boi_token_index=318, eoi_token_index=319)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _liven_gemma(model)
    model.save_pretrained(path)
    return model
