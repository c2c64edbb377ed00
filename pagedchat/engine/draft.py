"""Draft-model proposals for speculative decoding (see speculative.py)."""

from __future__ import annotations

from pagedchat.errors import UserError


class DraftProposer:
    def __init__(self, config, engine):
        raise UserError("--speculate draft (--draft-model) is not available yet in this build; use --speculate ngram")
