"""Which model class serves which HF `architectures` value, and how each is built.

A family is a name (what `models show` prints), the architectures it accepts, and a builder that turns the
HF config into a model whose parameters are still empty (the loader fills them from the checkpoint).
Families whose attention has sliding windows handle them themselves; for the others the loader caps the
context at the window (full attention equals window attention up to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pagedchat.model.checkpoint import materialize
from pagedchat.model.layers import RotaryEmbedding
from pagedchat.model.llama import ArchSpec, LlamaFamilyModel


@dataclass(frozen=True)
class Family:
    name: str
    label: str
    architectures: tuple[str, ...]
    build: Callable[..., nn.Module]   # (config, spec, max_len, device, dtype) -> empty model
    windowed: bool = False      # the model applies the config's sliding windows itself


def _llama(config, spec: ArchSpec, max_len: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    rotary = RotaryEmbedding(config, spec.head_dim, max_len, device=device)
    return materialize(lambda: LlamaFamilyModel(spec, rotary), device, dtype)


def _phi3(config, spec: ArchSpec, max_len: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    # Phi-3 is the Llama forward with qkv and gate_up already fused in the checkpoint (they load as they
    # are) and a rope that may be partial (Phi-4-mini) or longrope.
    from pagedchat.model.rope import TableRotary

    rotary = TableRotary.from_config(config, spec.head_dim, max_len, device)
    return materialize(lambda: LlamaFamilyModel(spec, rotary), device, dtype)


def _moe(config, spec: ArchSpec, max_len: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from pagedchat.model.moe import build_moe_model

    rotary = RotaryEmbedding(config, spec.head_dim, max_len, device=device)
    return materialize(lambda: build_moe_model(config, spec, rotary), device, dtype)


def _gemma(config, spec: ArchSpec, max_len: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from pagedchat.model.gemma import build_gemma_model

    return build_gemma_model(config, spec, max_len, device, dtype)


FAMILIES = (
    Family("llama", "Llama", ("LlamaForCausalLM",), _llama),
    Family("mistral", "Mistral", ("MistralForCausalLM",), _llama),
    Family("qwen2", "Qwen2", ("Qwen2ForCausalLM",), _llama),
    Family("qwen3", "Qwen3", ("Qwen3ForCausalLM",), _llama),
    Family("phi3", "Phi-3 / Phi-4", ("Phi3ForCausalLM",), _phi3),
    Family("qwen3_moe", "Qwen3-MoE (mixture of experts)", ("Qwen3MoeForCausalLM",), _moe),
    Family("mixtral", "Mixtral (mixture of experts)", ("MixtralForCausalLM",), _moe),
    Family("gemma2", "Gemma 2 (sliding-window + global layers)", ("Gemma2ForCausalLM",), _gemma, windowed=True),
    Family("gemma3", "Gemma 3 text (sliding-window + global layers)",
           ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), _gemma, windowed=True),
)

# Vision-language checkpoints whose text model is a family above (Gemma 3 from 4B up ships this way): their
# text model is loaded and serves text; the image tower is not loaded.
TEXT_PART_OF = ("Gemma3ForConditionalGeneration",)

SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def family_for(architecture: str | None) -> Family | None:
    return next((f for f in FAMILIES if architecture in f.architectures), None)


def text_part(config):
    """The text config of a vision-language checkpoint (TEXT_PART_OF), under the checkpoint's
    architecture so the family is still found; any other config as it is."""
    if not config.architectures or config.architectures[0] not in TEXT_PART_OF:
        return config
    text = config.text_config
    text.architectures = list(config.architectures)
    return text
