"""Structured output: token masks from llguidance, one matcher per sequence, applied batched in the step.

Why llguidance (over xgrammar; both run on CPU): masks are computed lazily per token (~10-20 us on the demo
tokenizer, no up-front schema compilation that grows with the vocabulary), a matcher can be deep-copied
(n variants and forks continue the parent's grammar state), rolled back (speculation), and a grammar is
validated up front with a one-line reason, so an unsupported schema is refused instead of ignored.
Numbers: docs/benchmarks.md, "Structured output".

The library is imported only when a request asks for a grammar: `run` without one never loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedchat.errors import RequestError, UserError

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: "json_schema" (source = the schema as JSON text) or "lark"."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls.json_schema({"type": "object"})

    @classmethod
    def from_schema_file(cls, path) -> "GrammarSpec":
        """`run --json-schema FILE` and the REPL's `/set schema FILE`: a JSON schema read from a file."""
        try:
            schema = json.loads(Path(path).read_text())
        except OSError as e:
            raise UserError(f"cannot read JSON schema {path}: {e.strerror}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"JSON schema {path} is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise UserError(f"JSON schema {path} must hold a JSON object (a schema), not {type(schema).__name__}")
        return cls.json_schema(schema)


class GrammarError(RequestError):
    """A grammar or schema the library cannot enforce: refused, never silently ignored."""


class Grammars:
    """Builds matchers for one tokenizer and masks batches of logits with them."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        import llguidance
        import llguidance.hf

        if tokenizer is None or not getattr(tokenizer, "is_fast", False):
            raise GrammarError("structured output needs the model's fast (tokenizer.json) tokenizer")
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_token_ids else min(eos_token_ids)
        self.llg = llguidance
        as_transformers = getattr(tokenizer, "as_transformers", None)   # pagedchat's own tokenizer wraps it
        hf_tokenizer = as_transformers() if as_transformers is not None else tokenizer
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._compiled: dict[GrammarSpec, str] = {}

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec`; GrammarError (one line) when the library cannot enforce it."""
        grammar = self._compiled.get(spec)
        if grammar is None:
            grammar = self._compile(spec)
            error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise GrammarError(f"unsupported {spec.kind.replace('_', ' ')}: {_first_line(error)}")
            self._compiled[spec] = grammar
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"unsupported {spec.kind.replace('_', ' ')}: {_first_line(matcher.get_error())}")
        return matcher

    def _compile(self, spec: GrammarSpec) -> str:
        try:
            if spec.kind == "json_schema":
                # compact JSON (no free whitespace): a weak model cannot wander off into endless spaces
                return self.llg.LLMatcher.grammar_from_json_schema(spec.source,
                                                                   defaults={"whitespace_flexible": False})
            if spec.kind == "lark":
                return self.llg.LLMatcher.grammar_from_lark(spec.source)
        except ValueError as e:
            raise GrammarError(f"unsupported {spec.kind.replace('_', ' ')}: {_first_line(str(e))}") from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def mask(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """A copy of `logits` where row i keeps only what matchers[i] allows (None = row unconstrained)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        masked = logits.clone()
        if not rows:
            return masked
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        for k, i in enumerate(rows):   # in this thread: a worker pool's spinning would steal the model's cores
            matchers[i].unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
        allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().view(len(rows), -1)[:, :logits.shape[1]]
        index = torch.tensor(rows, device=logits.device)
        masked[index] = masked[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return masked

    def mask_drafted(self, logits: torch.Tensor, drafts: list[int], matcher) -> torch.Tensor:
        """The 1 + k rows of a speculating sequence, row i masked by the grammar state after drafts[:i]: the
        matcher walks the drafts and is rolled back, so the tokens kept are consumed once, on append. Rows
        past the first draft the grammar refuses stay unmasked: verification rejects that draft (its
        probability is 0 under its row's mask) and never reads them."""
        masked, walked = logits.clone(), 0
        for i in range(len(drafts) + 1):
            masked[i:i + 1] = self.mask(logits[i:i + 1], [matcher])
            if i == len(drafts) or masked[i, drafts[i]] == float("-inf"):
                break
            assert matcher.consume_token(drafts[i]), matcher.get_error()
            walked += 1
        matcher.rollback(walked)
        return masked


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar library"
