"""config.json read without transformers: importing it costs seconds of start-up (torch._dynamo, sympy,
torch.distributed), more than a small model's whole answer.

Only the architectures (with plain rope) the model code was checked against read this way; their defaults for fields a
config.json may leave out are transformers' own (tests compare the resulting ArchSpec with AutoConfig's).
Anything else goes through AutoConfig, which knows every family and remote code.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

# transformers' class defaults for the fields the loader reads, per architecture.
_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
    "MistralForCausalLM": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0,
                               sliding_window=4096, num_key_value_heads=8),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                             use_sliding_window=False, sliding_window=None, num_key_value_heads=32),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                             use_sliding_window=False, sliding_window=None, num_key_value_heads=32, head_dim=128),
}
_COMMON = dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False, head_dim=None,
               num_key_value_heads=None, rope_scaling=None, rope_parameters=None, eos_token_id=None)


def read_config(path: Path) -> SimpleNamespace | None:
    """The config as attributes, or None when its architecture needs AutoConfig (or the file is unreadable:
    AutoConfig then gives the error message)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "auto_map" in raw:
        return None
    arch = (raw.get("architectures") or [None])[0]
    if arch not in _DEFAULTS:
        return None
    values = {**_COMMON, **_DEFAULTS[arch], **raw}
    if not values.get("use_sliding_window", True):
        values["sliding_window"] = None  # as transformers' Qwen configs do
    rope = values["rope_parameters"] or values["rope_scaling"] or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None  # scaled rope tables come from transformers' own init functions
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", values["rope_theta"])}
    return SimpleNamespace(**values)
