"""Requests and their sequences: token ids, a block table, and how much of it has KV computed."""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedchat.engine.core.logprobs import TokenLogprob
from pagedchat.engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:   # only named in annotations: the torch-free one-shot path (pagedchat/quick) uses these types
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PINNED = "pinned"      # finished, still holding its blocks so a follow-up turn prefills only new tokens


_seq_ids = itertools.count()

# The last token of a sequence whose sampling step is still running on the device (overlapped steps,
# Engine.step): its id is known only once that step's tokens reach the host.
PENDING = -1


class Sequence:
    def __init__(self, request: "Request", index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index                  # variant number within its request
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chain keys of the leading full, computed blocks
        self.window_tables: list[list[int]] = []  # sliding-window layer groups' tables (window_groups.py)
        self.num_computed = 0               # tokens whose K/V are in the pool
        self.kv_resets = 0                  # times all its blocks were released (preemption, abort): a
                                            # draft model's KV kept beside them is gone too (draft.py)
        self.tier_hits = (0, 0)             # (RAM, disk) tokens loaded back at the last admission
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        self.parent: Sequence | None = None  # a pinned sequence to fork from at admission
        self.text = ""                      # detokenized output (stop strings cut off)
        self.emitted = 0                    # characters of text already streamed
        self.detok_offsets = (0, 0)         # slow-tokenizer detokenizer state (prefix_offset, read_offset)
        self.detok_stream = None            # fast-tokenizer DecodeStream
        self.score: float | None = None     # a beam-search hypothesis: its length-penalized log-probability
        self.logprobs: list[TokenLogprob] = []   # one per output token when the request asks for logprobs
        self.matcher = None                 # llguidance matcher of the request's grammar, at this output
        self.draft_ids: list[int] = []      # proposed tokens verified in this step (speculative decoding)
        self.spec = None                    # speculative.SpecState: acceptance history, n-gram index
        self.pending_row: int | None = None  # last token is PENDING: its row in the in-flight step's tokens
        self.ends_when_settled = False      # ... and that token ends it by length, whatever it is

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def drop_pending(self) -> None:
        """Forget a PENDING last token (its sequence ended another way before the token reached the host)."""
        assert self.pending_row is not None and self.token_ids[-1] == PENDING
        self.token_ids.pop()
        self.pending_row, self.ends_when_settled = None, False

    @property
    def settled_output_ids(self) -> list[int]:
        """The output tokens known on the host (a PENDING last token left out)."""
        end = self.num_tokens - (self.pending_row is not None)
        return self.token_ids[self.num_prompt_tokens:end]

    @property
    def reuses_prefix(self) -> bool:
        """Prompt log-probabilities and embeddings need every prompt position's hidden state: no cached
        prefix then."""
        params = self.request.params
        return params.prompt_logprobs is None and not params.embed

    @property
    def is_finished(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.PINNED)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={self.block_table})")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    keep: bool = False                   # pin finished variants (chat turns)
    sequences: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    prefix_hit_tokens: int | None = None  # set at first admission (reused from any tier)
    ram_hit_tokens: int = 0              # of those, loaded from the host-RAM tier
    disk_hit_tokens: int = 0             # of those, loaded from the disk tier
    forked: bool = False                 # the n variants exist (after the prompt's prefill)
    error: str | None = None
    beam: object | None = None           # a BeamSearch (engine/decoding/beam.py) when params.beam_width > 0
    # prompt_logprobs[i] scores prompt token i + 1 (the first token has no context to be scored against)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    hidden_sum: torch.Tensor | None = None   # embed: sum of the prompt's last hidden states so far (fp64)
    pooled: int = 0                          # prompt positions in hidden_sum
    context: list[list[int]] = field(default_factory=list)  # related token streams the n-gram drafts search

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def samples_on_host(self) -> bool:
        """Its steps need their tokens on the host before the next step (never overlapped): beams, grammars,
        logprobs."""
        p = self.params
        return p.beam_width > 0 or p.grammar is not None or p.logprobs is not None

    @property
    def finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.sequences)
