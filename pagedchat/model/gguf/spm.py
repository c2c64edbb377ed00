"""A pure-Python tokenizer for SentencePiece ("llama") GGUF vocabularies, equal to the `tokenizers` one.

Why it exists: start-up time. `tokenizer._backend` builds a `tokenizers.Tokenizer` whose BPE model needs its
merges as a list: for Gemma 3's 262k tokens that is 1.2M merges derived from the scores, about 2 s to build
and ingest, longer than a one-shot command should wait. This backend needs no merge list: a pair of adjacent
tokens can be merged exactly when their joined text is a token, and the rank `_score_merges` gives that merge
follows from the joined token's score, so each pair is ranked on the fly. Construction is one argsort of the
scores and a few dicts.

What it must equal: the `tokenizers.Tokenizer` that `_backend(vocab)` builds for this style, id for id and
character for character:
- added tokens (control, unknown and user-defined ones) are found in the raw text first, leftmost-longest, as
  the added vocabulary's Aho-Corasick automaton finds them; an rstrip token takes the whitespace after it;
- every stretch of text between them is normalized on its own: U+2581 before it (add_space_prefix; not
  before an empty stretch), U+2581 for every space;
- BPE over each stretch: characters that are tokens, the <0xNN> tokens of the UTF-8 bytes of the others
  (byte_fallback), the unknown token where a byte token is missing; then the adjacent pair of lowest merge
  rank, leftmost first among equals, is merged until none is left;
- BOS/EOS around the ids when add_special_tokens;
- decoding: U+2581 back to spaces, runs of <0xNN> tokens back to their UTF-8 text (one U+FFFD per byte of an
  invalid run), the pieces joined, then one leading space taken back (add_space_prefix).
"""

from __future__ import annotations

import heapq
import re

import numpy as np

from pagedchat.model.gguf.tokenizer import SPACE, USER_DEFINED

# Rust's regex \s (Unicode White_Space): what an rstrip token takes after it. str.isspace() differs (it also
# holds U+001C..U+001F), so the set is spelled out.
_WHITE_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                         "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_UNSEEN = object()


class Encoding:
    """What `encode` returns: the ids, and their token texts on demand."""

    __slots__ = ("ids", "_tokens")

    def __init__(self, ids: list[int], tokens: list[str]):
        self.ids = ids
        self._tokens = tokens

    @property
    def tokens(self) -> list[str]:
        return [self._tokens[i] for i in self.ids]


class SentencePieceBackend:
    """The subset of `tokenizers.Tokenizer` that pagedchat calls, for a SentencePiece `_Vocab`."""

    def __init__(self, vocab):
        assert vocab.style == "sentencepiece", f"a {vocab.style!r} vocabulary is not SentencePiece"
        self._tokens: list[str] = vocab.tokens
        self._index: dict[str, int] = vocab.index
        self._rank = _score_ranks(vocab.scores)
        self._byte_ids = [vocab.index.get(f"<0x{b:02X}>") for b in range(256)]
        unk = vocab.ids["unk"]
        self._unk = None if unk is None else vocab.index[vocab.tokens[unk]]
        self._space_prefix = bool(vocab.add_space_prefix)
        self._bos = [vocab.ids["bos"]] if vocab.add_bos and vocab.ids["bos"] is not None else []
        self._eos = [vocab.ids["eos"]] if vocab.add_eos and vocab.ids["eos"] is not None else []
        self._added, self._special = _added_tokens(vocab)
        self._rstrip = set(vocab.rstrip)
        self._lengths = _lengths_by_prefix(self._added)
        self._first_chars = _first_chars_pattern(self._added)
        self._symbols_of: dict[str, int | tuple[int, ...] | None] = {}   # by character, filled as met
        # `tokenizers`' switch: special added tokens are left in the text (llama.cpp's parse_special=False)
        self.encode_special_tokens = False

    # -- the tokenizers.Tokenizer calls ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids: list[int] = []
        for piece, token in self._split_on_added_tokens(text):
            if token is not None:
                ids.append(token)
            elif piece:
                ids += self._bpe(self._normalize(piece))
        if add_special_tokens:
            ids = self._bos + ids + self._eos
        return Encoding(ids, self._tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:   # `tokenizers`' default
        pieces = []
        for i in ids:
            if i < 0:   # as the Rust binding refuses it
                raise OverflowError("can't convert negative int to unsigned")
            if i >= len(self._tokens):
                continue   # an unknown id decodes to nothing
            token = self._tokens[i]
            if skip_special_tokens and token in self._special:
                continue
            pieces.append(token.replace(SPACE, " "))
        text = "".join(_bytes_to_text(pieces))
        return text[1:] if self._space_prefix and text.startswith(" ") else text

    def id_to_token(self, i: int) -> str | None:
        return self._tokens[i] if 0 <= i < len(self._tokens) else None

    def token_to_id(self, text: str) -> int | None:
        return self._index.get(text)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tokens)   # every added token is a vocabulary token: no ids beyond it

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self._index)

    # -- added tokens ------------------------------------------------------------------------------------------
    def _split_on_added_tokens(self, text: str) -> list[tuple[str, int | None]]:
        """(stretch, None) and (token text, id) in order, as the added vocabulary splits the raw text. The
        search resumes where a match ends, not after the whitespace an rstrip token took, so a later match may
        begin inside that whitespace: the splits then overlap, as they do in `tokenizers`."""
        splits, done = [], 0
        for start, end, token in self._added_matches(text):
            if self.encode_special_tokens and self._tokens[token] in self._special:
                continue
            if token in self._rstrip:
                end = _skip_white_space(text, end)
            if done < start:
                splits.append((text[done:start], None))
            splits.append((text[start:end], token))
            done = end
        if done < len(text):
            splits.append((text[done:], None))
        return splits

    def _added_matches(self, text: str):
        """Leftmost-longest, non-overlapping matches of the added tokens: (start, end, id)."""
        if self._first_chars is None:
            return
        added, lengths = self._added, self._lengths
        resume = 0
        for found in self._first_chars.finditer(text):
            start = found.start()
            if start < resume:
                continue
            token = None
            for length in lengths.get(text[start:start + 2], ()):
                token = added.get(text[start:start + length])
                if token is not None:
                    break
            else:
                length = 1
                token = added.get(text[start])
            if token is not None:
                resume = start + length
                yield start, resume, token

    # -- normalizer and model ----------------------------------------------------------------------------------
    def _normalize(self, piece: str) -> str:
        """The normalizer runs on each stretch between added tokens: so each non-empty one gets the prefix."""
        piece = piece.replace(" ", SPACE)
        return SPACE + piece if self._space_prefix else piece

    def _bpe(self, text: str) -> list[int]:
        symbols = self._initial_symbols(text)
        return _merge(symbols, self._tokens, self._index, self._rank) if len(symbols) > 1 else symbols

    def _initial_symbols(self, text: str) -> list[int]:
        """One symbol per character that is a token; the byte tokens of one that is not; the unknown token
        where a byte token is missing. As in `tokenizers`, an unknown token is written only when the next
        character that is a token (or another unknown one, or the end) comes: byte tokens of characters in
        between go before it."""
        symbols: list[int] = []
        pending_unk = None
        symbols_of = self._symbols_of
        for char in text:
            found = symbols_of.get(char, _UNSEEN)
            if found is _UNSEEN:
                found = symbols_of[char] = self._char_symbols(char)
            if type(found) is int:   # the character is a token
                if pending_unk is not None:
                    symbols.append(pending_unk)
                    pending_unk = None
                symbols.append(found)
            elif found is not None:   # its byte tokens
                symbols += found
            elif self._unk is not None:
                if pending_unk is not None:
                    symbols.append(pending_unk)
                pending_unk = self._unk
        if pending_unk is not None:
            symbols.append(pending_unk)
        return symbols

    def _char_symbols(self, char: str) -> int | tuple[int, ...] | None:
        """The character's token, else the tuple of its byte tokens, else None."""
        token = self._index.get(char)
        if token is not None:
            return token
        byte_ids = tuple(self._byte_ids[b] for b in char.encode("utf-8"))
        return None if None in byte_ids else byte_ids


# -- building blocks -------------------------------------------------------------------------------------------
def _score_ranks(scores: np.ndarray) -> list[int]:
    """Each token's place when sorted best score first, ties in token order (numpy's stable sort, NaN last).

    `_score_merges` lists every split (token, cut) in token order, cuts ascending, and sorts them stably by
    the joined token's negated score. So a merge's rank orders as (this place of the joined token, length of
    its left side): the key used here to rank a pair without the list."""
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(len(order))
    return ranks.tolist()


def _merge(symbols: list[int], tokens: list[str], index: dict[str, int], rank: list[int]) -> list[int]:
    """`tokenizers`' Word.merge_all: a heap of (rank, position) for every adjacent pair whose joined text is a
    token; pop the lowest, skip it where it no longer holds (its left symbol merged away, or the pair there now
    joins into another token), merge, queue the new pairs with the neighbours. A position is the index of the
    left symbol's first initial symbol, which is what `tokenizers` breaks ties by."""
    n = len(symbols)
    texts = [tokens[s] for s in symbols]
    following = list(range(1, n)) + [-1]
    preceding = list(range(-1, n - 1))
    removed = [False] * n
    get, push, pop = index.get, heapq.heappush, heapq.heappop

    heap = []
    for pos in range(n - 1):
        left = texts[pos]
        joined = get(left + texts[pos + 1])
        if joined is not None:
            heap.append((rank[joined], len(left), pos, joined))
    heapq.heapify(heap)

    while heap:
        _, _, pos, joined = pop(heap)
        right = following[pos]
        if removed[pos] or right < 0 or get(texts[pos] + texts[right]) != joined:
            continue
        symbols[pos], texts[pos] = joined, tokens[joined]
        removed[right] = True
        after = following[pos] = following[right]
        if after >= 0:
            preceding[after] = pos
        before = preceding[pos]
        if before >= 0:
            left = texts[before]
            new = get(left + texts[pos])
            if new is not None:
                push(heap, (rank[new], len(left), before, new))
        if after >= 0:
            new = get(texts[pos] + texts[after])
            if new is not None:
                push(heap, (rank[new], len(texts[pos]), pos, new))

    out, pos = [], 0
    while pos >= 0:
        out.append(symbols[pos])
        pos = following[pos]
    return out


def _added_tokens(vocab) -> tuple[dict[str, int], frozenset[str]]:
    """Added token text -> id, and the texts of the special ones (control and unknown: skipped in decoding
    with skip_special_tokens); user-defined ones are matched alike but always shown."""
    ids = vocab.special_token_ids()
    kinds = vocab.kinds[ids].tolist()
    added = {vocab.tokens[i]: i for i in ids}
    special = frozenset(vocab.tokens[i] for i, kind in zip(ids, kinds) if kind != USER_DEFINED)
    return added, special


def _lengths_by_prefix(added: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The lengths of the added tokens by their first two characters (one for one-character tokens), longest
    first: at a position, the first length whose text is an added token is the longest match there."""
    lengths: dict[str, set[int]] = {}
    for text in added:
        lengths.setdefault(text[:2], set()).add(len(text))
    return {prefix: tuple(sorted(found, reverse=True)) for prefix, found in lengths.items()}


def _first_chars_pattern(added: dict[str, int]):
    """A character class of the added tokens' first characters: where a match can begin."""
    if not added:
        return None
    return re.compile("[" + "".join(re.escape(c) for c in sorted({t[0] for t in added})) + "]")


def _skip_white_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITE_SPACE:
        at += 1
    return at


def _byte_value(piece: str) -> int | None:
    """The byte a "<0xNN>" piece stands for in `tokenizers`' ByteFallback decoder: six UTF-8 bytes, "<0x",
    two characters Rust's u8::from_str_radix(.., 16) reads (it takes a leading "+"), ">"."""
    if len(piece) != 6 or not piece.startswith("<0x") or piece[5] != ">":
        return None
    digits = piece[3:5]
    if digits[0] == "+":
        digits = digits[1:]
    return int(digits, 16) if digits and all(c in _HEX_DIGITS for c in digits) else None


def _bytes_to_text(pieces: list[str]) -> list[str]:
    """ByteFallback: each run of byte pieces becomes its UTF-8 text, or one U+FFFD per byte if it is not
    valid UTF-8 as a whole."""
    out, run = [], bytearray()
    for piece in pieces:
        value = _byte_value(piece)
        if value is not None:
            run.append(value)
            continue
        if run:
            out.append(_run_text(run))
            run = bytearray()
        out.append(piece)
    if run:
        out.append(_run_text(run))
    return out


def _run_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
