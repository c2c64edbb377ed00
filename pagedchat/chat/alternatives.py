"""A reply's token alternatives (`/logprobs on`) and the choice of one to branch from (`/branch`).

With /logprobs on, every reply token's log-probability and its best alternatives come from the engine (the
same numbers the server returns as `top_logprobs`) and are stored on the reply node, so `/branch` works on
any reply of the tree, in a later session too. `/branch I ALT` makes a sibling reply that keeps the first I
tokens, puts ALT at position I and generates on from there: its prompt shares all but one token with the
pinned reply, so it costs one token of prefill.
"""

from __future__ import annotations

import math
import shlex

from pagedchat.errors import UserError

TOP_ALTERNATIVES = 5    # alternatives kept per reply token
SURE = 0.9              # the compact view skips tokens chosen with at least this probability
DIGITS = 4              # stored log-probabilities are rounded: a session file holds 6 pairs per token


def compact(logprobs) -> list[list]:
    """Engine TokenLogprobs as stored on a node: per token [logprob, [[token_id, logprob], ...best first]]."""
    return [[round(lp.logprob, DIGITS), [[t, round(v, DIGITS)] for t, v in lp.top]] for lp in logprobs]


def is_valid(rows) -> bool:
    """The stored shape, as read back from a session file."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    return isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == 2 and number(r[0]) and isinstance(r[1], list)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and number(p[1]) for p in r[1])
        for r in rows)


def others(row: list, chosen: int) -> list[tuple[int, float]]:
    """The alternatives of one token: the top list without the token that was chosen."""
    return [(t, lp) for t, lp in row[1] if t != chosen]


def is_hesitant(row: list) -> bool:
    return math.exp(row[0]) < SURE


def parse_branch_args(arg: str, usage: str) -> tuple[int, str]:
    """`I ALT`: ALT may be quoted (a token with a leading space: `/branch 4 " London"`)."""
    try:
        words = shlex.split(arg)
    except ValueError as e:
        raise UserError(f"usage: {usage} ({e})") from None
    if len(words) != 2 or not words[0].lstrip("#").isdigit():
        raise UserError(f"usage: {usage} (token indices and alternatives are listed by /logprobs)")
    return int(words[0].lstrip("#")), words[1]


def choose(word: str, row: list | None, chosen: int, decode, encode) -> int:
    """The token ALT names: an alternative's rank as /logprobs lists it (1 = the most likely other token),
    an alternative's text (exactly, else ignoring surrounding spaces when that names one), or any text that
    is a single token of the vocabulary."""
    alternatives = others(row, chosen) if row is not None else []
    if word.isdigit() and alternatives and 1 <= int(word) <= len(alternatives):
        return alternatives[int(word) - 1][0]
    exact = [t for t, _ in alternatives if decode([t]) == word]
    if exact:
        return exact[0]
    loose = [t for t, _ in alternatives if decode([t]).strip() == word.strip()]
    if len(loose) == 1:
        return loose[0]
    ids = encode(word)
    if len(ids) == 1:
        return ids[0]
    listed = f" (this position's alternatives: 1-{len(alternatives)})" if alternatives else ""
    raise UserError(f"{word!r} is {len(ids)} tokens, not one: give an alternative's rank or text{listed}")
