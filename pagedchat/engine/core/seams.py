"""The two things an Engine can be given instead of building them: the loaded model and the model runner.
Property tests and the memory benchmarks pass their own (no model at all); these Protocols say exactly
what the engine reads of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedchat.engine.core.scheduler import ScheduledBatch
from pagedchat.engine.core.sequence import Sequence


class ModelSpec(Protocol):
    vocab_size: int


class ModelSource(Protocol):
    """What the engine reads of a `LoadedModel` (pagedchat.model.loader)."""
    path: object                 # shown in error messages
    tokenizer: object | None     # None: the engine takes token ids only
    eos_token_ids: list[int]
    max_model_len: int
    spec: ModelSpec
    device: torch.device


class StepRunner(Protocol):
    """What the engine needs of a `ModelRunner` (pagedchat.engine.core.runner)."""
    num_blocks: int              # the KV pool's size, fixed when the runner allocated it

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run one scheduled batch: logits for the sequences that sample this step, and those sequences
        (in row order); (None, []) when no sequence finished its prompt this step."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy (src, dst) blocks now, in every cache indexed by the pool's block ids (used only with a draft
        model: engine/decoding/draft.py copies shared blocks before the draft writes)."""
        ...


@dataclass
class VocabSpec:
    vocab_size: int


@dataclass
class NoModel:
    """A ModelSource with no model behind it: token ids only (no tokenizer), any id below vocab_size is
    valid. The model-free runners of the property tests and the memory benchmark pair with it."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    path: str = "(no model)"
    tokenizer: None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def spec(self) -> VocabSpec:
        return VocabSpec(self.vocab_size)
