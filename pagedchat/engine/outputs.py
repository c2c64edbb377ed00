"""What the engine hands to its callers: token events, finished outputs, branch handles, stats.

These are the only engine objects a front end (chat, run, serve) holds; everything else of the engine
(pool, scheduler, requests, runner) stays behind `Engine`'s methods.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedchat.engine.kv.block_pool import PoolStats
from pagedchat.engine.core.logprobs import TokenLogprob
from pagedchat.engine.core.sequence import Sequence, SeqStatus


class Branch:
    """A handle on one line of generation the engine keeps: a finished variant of a `keep=True` request
    (its KV blocks stay pinned between turns) or, for `Engine.fork`, a running one.

    Pass it as `parent=` to `Engine.add_request` to continue from its KV, to `Engine.fork` to branch off it,
    and to `Engine.release` when the branch is no longer needed. Under memory pressure the engine drops the
    pins of the least recently used branches (`is_pinned` turns False): the tokens stay, and a follow-up
    re-prefills them, mostly from the prefix cache.
    """

    __slots__ = ("sequence",)

    def __init__(self, sequence: Sequence):
        self.sequence = sequence    # the engine's own object: engine code and white-box tests only

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output so far: the exact tokens a follow-up turn continues from."""
        return self.sequence.token_ids

    @property
    def num_tokens(self) -> int:
        return self.sequence.num_tokens

    @property
    def is_pinned(self) -> bool:
        """Still holding its KV blocks (False once released, or dropped under memory pressure)."""
        return self.sequence.status == SeqStatus.PINNED

    def __eq__(self, other) -> bool:
        return isinstance(other, Branch) and other.sequence is self.sequence

    def __hash__(self) -> int:
        return id(self.sequence)

    def __repr__(self) -> str:
        return f"Branch({self.sequence!r})"


@dataclass
class TokenEvent:
    request_id: str
    index: int                 # variant
    token_ids: list[int]       # new this step
    text: str                  # new text this step (held back while it could still become a stop string)
    finish_reason: str | None = None   # stop | length | abort | error
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None   # for token_ids, when the request asks for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None   # on a variant's first token, when asked for (echo)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    handle: Branch | None = None       # pinned branch (keep=True): pass as `parent` to continue from it
    error: str | None = None
    score: float | None = None         # beam search: the hypothesis' score (outputs come best first)
    logprobs: list[TokenLogprob] | None = None   # one per token_ids entry, when asked for

    @property
    def token_ids_all(self) -> list[int]:
        """Prompt + output: the exact tokens a follow-up turn continues from."""
        return list(self.handle.token_ids) if self.handle is not None else []


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prefix_hit_tokens: int                 # prompt tokens whose KV was reused (any tier)
    ttft_s: float | None
    total_s: float | None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None   # for prompt tokens 1.. (echo), when asked for
    embedding: list[float] | None = None   # embed: mean of the prompt's last-layer hidden states (final norm)
    ram_hit_tokens: int = 0                # of prefix_hit_tokens: loaded from the host-RAM tier
    disk_hit_tokens: int = 0               # of prefix_hit_tokens: loaded from the disk tier

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineStats:
    pool_stats: PoolStats
    running: int
    waiting: int
    pinned: int
    pinned_blocks: int
    preemptions: int
    spec: dict | None = None   # speculative decoding counters (SpecStats.as_dict) while it is on
