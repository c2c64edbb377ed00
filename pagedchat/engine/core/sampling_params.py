"""What a request asks of the sampler. Validation errors are user errors (one clear line)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from pagedchat.errors import UserError

if TYPE_CHECKING:   # torch-free at run time: the CLI checks sampling flags before torch loads
    from pagedchat.engine.core.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20       # alternatives per token a request may ask for (logprobs.py computes them)


def _setting(default=None, kind: type = float, **kw):
    """A field users set by name (CLI flag, /set, models.toml [sampling], a session, the server)."""
    if "default_factory" not in kw:
        kw["default"] = default
    return field(metadata={"setting": kind}, **kw)


@dataclass
class SamplingParams:
    temperature: float = _setting(1.0)          # 0 = greedy
    top_p: float = _setting(1.0)
    top_k: int = _setting(0, int)               # 0 = off
    min_p: float = _setting(0.0)
    max_tokens: int = _setting(256, int)
    seed: int | None = _setting(None, int)      # per request; variant i uses an independent stream derived from it
    repetition_penalty: float = _setting(1.0)
    stop: list[str] = _setting(kind=list, default_factory=list)
    # set by the program, not by name: token ids that end a reply, the server's ignore_eos, variants
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                      # variants: the prompt is prefilled once, the n children are forks
    beam_width: int = 0             # > 0: beam search with this many beams (transformers' num_beams)
    length_penalty: float = 1.0     # beam hypotheses score sum_logprob / length ** length_penalty
    early_stopping: bool | str = False  # beam search stops: True (W finished), False (heuristic), "never"
    logprobs: int | None = None     # per generated token: its logprob and this many alternatives (0 = none)
    prompt_logprobs: int | None = None   # the same for every prompt token (echo); turns off prefix reuse
    grammar: GrammarSpec | None = None   # structured output: every token is masked to what it allows
    embed: bool = False             # also mean-pool the prompt's last hidden states (turns off prefix reuse)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        self.stop = [s for s in self.stop if s]
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.n >= 1, f"n (variants) must be >= 1, got {self.n}"),
            (self.beam_width >= 0, f"beam width must be >= 1, got {self.beam_width}"),
            (not self.beam_width or self.n == 1, "beam search returns its beams as its outputs: n must be 1"),
            (isinstance(self.early_stopping, bool) or self.early_stopping == "never",
             f"early_stopping must be true, false or never, got {self.early_stopping!r}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    def _check_types(self) -> None:
        """Values from models.toml, a --file line or a session file arrive untyped: say which one is wrong
        instead of failing later inside a comparison."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty"):
            if not _is_number(getattr(self, name), float):
                raise UserError(f"{name} must be a number, got {getattr(self, name)!r}")
            if math.isinf(getattr(self, name)):
                raise UserError(f"{name} must be finite, got {getattr(self, name)}")
        for name in ("top_k", "max_tokens", "n", "beam_width"):
            if not _is_number(getattr(self, name), int):
                raise UserError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not _is_number(getattr(self, name), int):
                raise UserError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_number(self.seed, int):
            raise UserError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise UserError(f"seed must fit in 64 bits, got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise UserError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_number(t, int) for t in self.stop_token_ids):
            raise UserError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


# The sampling settings users set by name, and the type each takes: every front end derives its keys from here.
SETTING_TYPES: dict[str, type] = {f.name: f.metadata["setting"] for f in fields(SamplingParams) if "setting" in f.metadata}
SETTING_KEYS: tuple[str, ...] = tuple(SETTING_TYPES)


def _is_number(value, kind: type) -> bool:
    """An int (or, for kind=float, an int or a float); bools are not numbers here."""
    allowed = (int, float) if kind is float else (int,)
    return isinstance(value, allowed) and not isinstance(value, bool)
