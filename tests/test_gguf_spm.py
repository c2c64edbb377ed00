"""The pure-Python SentencePiece backend (pagedchat/model/gguf/spm.py) against the `tokenizers` pipeline that
`tokenizer._backend` builds from the same vocabulary: ids, text and the vocabulary calls must be identical.

On Gemma 3's real vocabulary (262k tokens) over thousands of generated texts and id sequences, and on small
vocabularies built here that force what the real one rarely shows: equal scores, a token joined by different
splits, missing byte tokens, the unknown token, no space prefix, Phi-3's rstrip tokens."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from pagedchat.model.gguf import tokenizer as gguf_tokenizer
from pagedchat.model.gguf.spm import SentencePieceBackend
from pagedchat.model.gguf.tokenizer import _backend, _Vocab, load_gguf_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"


# -- comparing the two backends ------------------------------------------------------------------------------------
def _both(metadata: dict) -> tuple[SentencePieceBackend, object]:
    vocab = _Vocab(metadata, "x.gguf")
    return SentencePieceBackend(vocab), _backend(vocab)


def _assert_same_ids(mine, hf, texts) -> None:
    for text in texts:
        for add in (True, False):
            assert mine.encode(text, add_special_tokens=add).ids == hf.encode(text, add_special_tokens=add).ids, \
                (text, add)


def _assert_same_text(mine, hf, id_lists) -> None:
    for ids in id_lists:
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)


def _assert_same_vocabulary(mine, hf, n: int, texts) -> None:
    for added in (True, False):
        assert mine.get_vocab_size(with_added_tokens=added) == hf.get_vocab_size(with_added_tokens=added) == n
    for i in [*range(n), n, n + 1, 10 ** 6]:
        assert mine.id_to_token(i) == hf.id_to_token(i), i
    for text in texts:
        assert mine.token_to_id(text) == hf.token_to_id(text), text


def _metadata(entries: list[tuple[str, float, int]], **keys) -> dict:
    """A "llama" (SentencePiece) vocabulary from (text, score, token type) entries; keys are tokenizer.ggml.*
    names, or full GGUF keys where they hold a dot."""
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [t for t, _, _ in entries],
            "tokenizer.ggml.scores": [s for _, s, _ in entries],
            "tokenizer.ggml.token_type": [k for _, _, k in entries],
            **{(k if "." in k else f"tokenizer.ggml.{k}"): v for k, v in keys.items()}}


SPECIALS = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
BYTES = [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]


def _ids(backend, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


# -- the real vocabulary: Gemma 3 --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    from pagedchat.model.gguf.reader import open_gguf
    from real_files import real_file

    path = real_file("gemma3")
    vocab = _Vocab(open_gguf([path]).metadata, str(path))
    return vocab, SentencePieceBackend(vocab), _backend(vocab)


_WORDS = ("the of and a to in is you that it he was for on are with as I his they be at one have this from or had "
          "by hot word but what some we can out other were all there when up use your how said an each she which do "
          "their time if will way about many then them write would like so these her long make thing see him two "
          "tokenization Internationalization don't it's naïve café Ångström straße HTTP JSON x86_64 e.g. U.S.A. "
          "snake_case camelCase SCREAMING unbelievably antidisestablishmentarianism").split()
_PUNCTUATION = list(".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`") + ["...", "…", "—", "–", "«", "»", "¿", "¡", "→", "©"]
_DIGITS = ["0", "7", "42", "1234", "3.14159", "-17", "1,000,000", "2024-01-31", "0x1F", "1e-9", "٣", "５"]
_WHITE = ([" " * n for n in (1, 1, 1, 2, 3, 4, 7, 31, 32, 33, 40)] + ["\n" * n for n in (1, 1, 2, 3, 31, 32, 40)]
          + ["\t" * n for n in (1, 2, 3, 31, 32)] + ["\r\n", " \n ", "\n \n", "\t \t", "\u3000", "\xa0", SPACE])
_SCRIPTS = ["日本語の文章です", "中文的句子", "한국어 문장", "Привет", "Ελληνικά", "مرحبا", "שלום", "हिन्दी", "ภาษาไทย", "ꦗꦮ"]
_ASTRAL = ["🦙", "🚀", "👍🏽", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𐐀𐐨", "\U0001F9FF", "\U00020000", "\U0002A6DF",
           "\U0001D11E"]
_COMBINING = ["e\u0301", "a\u0308", "\u0327", "\u20dd", "\u0301\u0301", "\u0e31", "\u093f"]
_CONTROLS = [chr(c) for c in (*range(0, 32), 127, 0x80, 0x85, 0x9F)] + ["\u200b", "\u200d", "\ufeff", "\u2028"]
# supplementary private use, noncharacters, unassigned: characters no token holds (the test checks), so byte
# fallback (Gemma has tokens for the BMP's private use area)
_ABSENT = ["\uffff", "\U0003FFFE", "\U000F0000", "\U0010FFFD", "\ufdd0", "\U000E01EF", "\u0378", "\U0001FFFF"]
_ADDED = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "[multimodal]", "</s>",
          "<s>", "<table>", "</td>", "<unused0>", "<unused6241>", "<start_of_image>", "<bos><eos>",
          "<start_of_turn", "end_of_turn>", "<0x41>", "<<bos>>", "<unk", "[multimodal"]
_POOLS = [(_WORDS, 30), (_PUNCTUATION, 8), (_DIGITS, 6), (_WHITE, 14), (_SCRIPTS, 5), (_ASTRAL, 4), (_COMBINING, 3),
          (_CONTROLS, 3), (_ABSENT, 3), (_ADDED, 8)]


def _generated_texts(n: int, seed: int) -> list[str]:
    """Mixes of every kind of piece; added-token texts also inside words; spaces at the edges."""
    rng = random.Random(seed)
    pools, weights = zip(*_POOLS)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 24)):
            piece = rng.choice(rng.choices(pools, weights)[0])
            if rng.random() < 0.1:   # an added token's text inside a word
                word = rng.choice(_WORDS)
                cut = rng.randint(0, len(word))
                piece = word[:cut] + rng.choice(_ADDED) + word[cut:]
            parts.append(piece)
        text = rng.choice(["", " "]).join(parts)
        if rng.random() < 0.3:
            text = rng.choice(_WHITE) + text
        if rng.random() < 0.3:
            text = text + rng.choice(_WHITE)
        texts.append(text)
    return texts


_PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
          "was the season of Darkness, it was the spring of hope, it was the winter of despair.")


def _long_prose(seed: int, paragraphs: int = 60) -> str:
    """About 4,000 tokens of prose: sentences of common words, paragraphs, a quotation now and then."""
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(_WORDS[:90]) for _ in range(rng.randint(4, 18))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ";"]))
        out.append(" ".join(sentences) + (" " + _PROSE if rng.random() < 0.2 else ""))
    return "\n\n".join(out)


def test_gemma_generated_texts_give_the_same_ids(gemma):
    vocab, mine, hf = gemma
    assert not any(c in vocab.index for c in "".join(_ABSENT))   # byte fallback is exercised
    texts = ["", " ", "  ", "\n", _PROSE, " " + _PROSE + " ", _long_prose(0), *_generated_texts(2500, seed=0)]
    _assert_same_ids(mine, hf, texts)


def test_gemma_random_id_sequences_give_the_same_text(gemma):
    """Random ids, byte tokens forming invalid (and valid) UTF-8, special and user-defined tokens, ids past the
    vocabulary (decoded to nothing)."""
    vocab, mine, hf = gemma
    n = len(vocab.tokens)
    rng = random.Random(1)
    byte_ids = [vocab.index[f"<0x{b:02X}>"] for b in range(256)]
    control = [i for i in vocab.special_token_ids() if vocab.kinds[i] != USER_DEFINED]
    shown = [i for i in vocab.special_token_ids() if vocab.kinds[i] == USER_DEFINED]
    utf8 = [byte_ids[b] for c in "é日🦙\U0010FFFD" for b in c.encode()]
    draws = [lambda: rng.randrange(n), lambda: rng.choice(byte_ids), lambda: rng.choice(byte_ids[0x80:]),
             lambda: rng.choice(control[:20] + control[-5:]), lambda: rng.choice(shown), lambda: rng.choice(utf8),
             lambda: rng.randrange(1000), lambda: rng.choice([n, n + 7])]
    id_lists = [[], [n], byte_ids[0xC3:0xC4] + byte_ids[0xA9:0xAA], utf8, utf8[1:], utf8[:-1]]
    for _ in range(2500):
        id_lists.append([rng.choice(draws)() for _ in range(rng.randint(1, 16))])
    id_lists += [hf.encode(text).ids for text in _generated_texts(300, seed=2)]
    _assert_same_text(mine, hf, id_lists)


def test_gemma_vocabulary_calls_agree(gemma):
    vocab, mine, hf = gemma
    _assert_same_vocabulary(mine, hf, len(vocab.tokens), vocab.tokens[::7] + ["", "not a token", "<0x100>", "▁▁▁x"])


def test_gemma_special_tokens_left_in_the_text(gemma):
    """`tokenizers`' encode_special_tokens (llama.cpp's parse_special=False): control tokens are not matched,
    user-defined ones still are."""
    _, mine, hf = gemma
    texts = _generated_texts(300, seed=3)
    mine.encode_special_tokens = hf.encode_special_tokens = True
    try:
        _assert_same_ids(mine, hf, texts)
    finally:
        mine.encode_special_tokens = hf.encode_special_tokens = False


def test_light_gemma_tokenizer_builds_no_merges_and_equals_the_default(gemma, monkeypatch):
    from pagedchat.model.gguf.reader import open_gguf
    from real_files import real_file

    path = real_file("gemma3")
    metadata = open_gguf([path]).metadata
    default = load_gguf_tokenizer(metadata, str(path))
    monkeypatch.setattr(gguf_tokenizer, "_backend", lambda vocab: pytest.fail("the light path built `tokenizers`"))
    light = load_gguf_tokenizer(metadata, str(path), light=True)
    assert isinstance(light.backend_tokenizer, SentencePieceBackend)
    assert (len(light), light.bos_token_id, light.eos_token_id, light.eog_token_ids) == \
        (len(default), default.bos_token_id, default.eos_token_id, default.eog_token_ids)
    for text in ["<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", _PROSE, ""]:
        ids = default.encode(text)
        assert light.encode(text) == ids and light.encode(text, add_special_tokens=False) == ids[1:]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == default.decode(ids, skip_special_tokens=skip)
    assert light.convert_ids_to_tokens([105, 106]) == ["<start_of_turn>", "<end_of_turn>"]


def test_light_gemma_tokenizer_does_not_import_tokenizers():
    from real_files import real_file

    path = real_file("gemma3")
    code = ("import sys, pathlib; from pagedchat.model.gguf.reader import open_gguf; "
            "from pagedchat.model.gguf.tokenizer import load_gguf_tokenizer; "
            f"p = pathlib.Path({str(path)!r}); "
            "t = load_gguf_tokenizer(open_gguf([p]).metadata, str(p), light=True); "
            "t.decode(t.encode('<start_of_turn>user\\nhi 🦙<end_of_turn>'), skip_special_tokens=True); "
            "assert 'tokenizers' not in sys.modules, 'tokenizers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_light_leaves_other_vocabularies_to_tokenizers():
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                "tokenizer.ggml.tokens": ["a", "b", "ab", "<|endoftext|>"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
                "tokenizer.ggml.merges": ["a b"]}
    tok = load_gguf_tokenizer(metadata, "x.gguf", light=True)
    assert type(tok.backend_tokenizer).__module__.startswith("tokenizers")
    assert tok.encode("ab") == [2]


# -- small vocabularies that force the tricky cases --------------------------------------------------------------------
@pytest.mark.parametrize("first", ["ab", "bc"])
def test_equal_scores_rank_by_token_order(first):
    """"ab" and "bc" score alike: the merge of the earlier token comes first, as in `_score_merges`' list."""
    second = "bc" if first == "ab" else "ab"
    entries = SPECIALS + [(first, -1.0, NORMAL), (second, -1.0, NORMAL)] + [(c, -9.0, NORMAL) for c in "abc"]
    mine, hf = _both(_metadata(entries, add_space_prefix=False))
    expected = {"ab": ["ab", "c"], "bc": ["a", "bc"]}[first]
    assert [mine.id_to_token(i) for i in _ids(mine, "abc")] == expected
    _assert_same_ids(mine, hf, ["".join(p) for n in range(7) for p in itertools.product("abc", repeat=n)])


def test_a_token_joined_by_two_splits_ranks_the_shorter_left_side_first():
    """T = "<0x41>q" is joined from ("<0x41>", "q") (cut 6: "A" is no token, its byte token is) and from
    ("<", "0x41>q") (cut 1, the text spelled out). In "Aq<0x41>q" both pairs stand when T's turn comes: the
    split with the shorter left side ranks first although it lies to the right, and the token it makes then
    joins "q" on its left ("q<0x41>q" scores above T) before the other pair merges."""
    pieces = [("0x", 50.0), ("0x4", 40.0), ("0x41", 30.0), ("0x41>", 20.0), ("0x41>q", 10.0), ("q<0x41>q", 5.0),
              ("<0x41>q", -5.0)] + [(c, -9.0) for c in "<0x41>q"]
    entries = SPECIALS + BYTES + [(t, s, NORMAL) for t, s in pieces]
    mine, hf = _both(_metadata(entries, add_space_prefix=False))
    assert [mine.id_to_token(i) for i in _ids(mine, "Aq<0x41>q")] == ["<0x41>", "q<0x41>q"]
    _assert_same_ids(mine, hf, ["Aq<0x41>q", "<0x41>qAq", "AqAq<0x41>q<0x41>q", "qAq<0x41>q"])


def test_byte_fallback_and_the_unknown_token():
    """A character that is no token becomes its byte tokens; where one of those is missing, the unknown token.
    As in `tokenizers`, an unknown token waits for the next character that is a token, so the bytes of a
    character between them come first. A token joining byte or unknown tokens is merged like any other."""
    missing = {0xA9}   # "é" is C3 A9: unknown; "Z" (5A) and "ö" (C3 B6) fall back to bytes
    entries = (SPECIALS + [t for t in BYTES if int(t[0][3:5], 16) not in missing]
               + [(t, -1.0, NORMAL) for t in ("a", "b", "<unk>a", "<0x5A><0x5A>")])
    mine, hf = _both(_metadata(entries, add_space_prefix=False))
    assert [mine.id_to_token(i) for i in _ids(mine, "éZa")] == ["<0x5A>", "<unk>a"]
    assert [mine.id_to_token(i) for i in _ids(mine, "éöb")] == ["<0xC3>", "<0xB6>", "<unk>", "b"]
    assert [mine.id_to_token(i) for i in _ids(mine, "ZZé")] == ["<0x5A><0x5A>", "<unk>"]
    texts = ["".join(p) for n in range(6) for p in itertools.product("aébZö\U0001F999", repeat=n)]
    _assert_same_ids(mine, hf, texts)


def test_decoding_tokens_that_look_like_bytes():
    """The ByteFallback decoder reads a token as a byte by its text alone ("<0x+F>" too: Rust's from_str_radix
    takes a sign); U+2581 in any token, added ones too, decodes as a space; one leading space is taken back."""
    looks_like_bytes = ["<0x+F>", "<0xzz>", "<0x4>", "<0x041>", "<0xé>", "<0x-1>", "<0x 1>", "<0X41>", "<0xa9>"]
    entries = (SPECIALS + BYTES[:200] + [(t, -1.0, NORMAL) for t in looks_like_bytes]
               + [(SPACE + "x", -1.0, NORMAL), (SPACE, -1.0, NORMAL), (" ", -1.0, NORMAL), ("x", -1.0, NORMAL),
                  ("a" + SPACE + "b", 0.0, USER_DEFINED), ("<0x41>x", 0.0, CONTROL), ("<0xE3>", 0.0, CONTROL)])
    for prefix in (True, False):
        mine, hf = _both(_metadata(entries, add_space_prefix=prefix))
        n = len(entries)
        rng = random.Random(5)
        special = list(range(3)) + list(range(n - 7, n))
        id_lists = [[rng.choice([rng.randrange(n), rng.choice(special), rng.randrange(n - 17, n)])
                     for _ in range(rng.randint(0, 8))] for _ in range(3000)]
        _assert_same_text(mine, hf, id_lists)


def _random_vocabulary(seed: int, byte_tokens: str) -> list[tuple[str, float, int]]:
    """Pieces over a few characters (U+2581 among them) with scores from three levels (many ties); added
    tokens that overlap each other and the pieces; all, some or none of the byte tokens."""
    rng = random.Random(seed)
    alphabet = "ab" + SPACE + "c"
    added = [("<t>", 0.0, USER_DEFINED), ("ab<", 0.0, CONTROL), ("\t\t", 0.0, USER_DEFINED),
             ("  ", 0.0, USER_DEFINED), ("<t>x", 0.0, CONTROL), ("a" + SPACE, 0.0, USER_DEFINED)]
    kept = {"all": range(256), "some": sorted(rng.sample(range(256), 200)), "none": []}[byte_tokens]
    pieces = set(alphabet)
    while len(pieces) < 40:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    pieces = sorted(pieces - {t for t, _, _ in added})
    rng.shuffle(pieces)
    return (SPECIALS + added + [BYTES[b] for b in kept]
            + [(p, float(-rng.randrange(3)), NORMAL) for p in pieces])


@pytest.mark.parametrize("byte_tokens", ["all", "some", "none"])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_vocabularies_match(seed, prefix, byte_tokens):
    """Every text over "ab c" up to 6 characters and random texts mixing the pieces' characters, tabs, added
    tokens' texts and characters outside the vocabulary; Phi-3's name (odd seeds) makes the added tokens take
    the whitespace after them (rstrip), where a later added token may begin inside what one took."""
    entries = _random_vocabulary(seed, byte_tokens)
    name = {"general.name": "Phi-3 mini"} if seed % 2 else {}
    mine, hf = _both(_metadata(entries, add_space_prefix=prefix, **name))
    rng = random.Random(seed)
    chars = ["a", "b", "c", " ", SPACE, "\t", "\n", "<", ">", "t", "x", "é", "日", "\U0001F999", "\u3000", "\x1c",
             "<t>", "ab<", "\t\t", "  ", "</s>", "<s>", "<unk>"]
    texts = ["".join(p) for n in range(7) for p in itertools.product("ab c", repeat=n)]
    texts += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 20))) for _ in range(1500)]
    _assert_same_ids(mine, hf, texts)
    mine.encode_special_tokens = hf.encode_special_tokens = True
    _assert_same_ids(mine, hf, texts[-300:])
    n = len(entries)
    id_lists = [[rng.randrange(n + 2) for _ in range(rng.randint(0, 12))] for _ in range(1000)]
    _assert_same_text(mine, hf, id_lists)
    _assert_same_vocabulary(mine, hf, n, [t for t, _, _ in entries] + ["zz", SPACE * 9])
