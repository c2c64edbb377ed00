"""The GGUF tokenizer (pagedchat/model/gguf/tokenizer.py) against llama.cpp, through llama-cpp-python loading the
same file with vocab_only: token ids for a corpus of texts (with and without BOS, special tokens written in the
text, with and without parsing them), the text of ids (with and without special tokens) and the tokens that end
generation. The real files where they are present (_real_file), and vocabularies trained here and written with
gguf-py for every pre-tokenizer family and the SentencePiece options the real files do not cover."""

from __future__ import annotations

import ctypes
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pagedchat.errors import ModelLoadError
from pagedchat.model.gguf import tokenizer as gguf_tokenizer
from pagedchat.model.gguf.tokenizer import GGUFTokenizer, load_gguf_tokenizer, stop_token_ids

SMOLLM = "SmolLM2-135M-Instruct.Q4_1.gguf"   # gpt2 BPE, pre "smollm", ChatML template
GEMMA = "gemma-3-270m-q4_k_m.gguf"           # SentencePiece ("llama"), 262k tokens, no template
# llama.cpp's own vocabulary-only test files (models/ggml-vocab-*.gguf in its repository)
LLAMA_CPP_VOCABS = [f"ggml-vocab-{name}.gguf" for name in (
    "llama-spm", "phi-3", "baichuan", "llama-bpe", "qwen2", "qwen35", "gpt-2", "mpt", "gpt-neox", "falcon", "starcoder",
    "refact", "command-r", "deepseek-llm", "deepseek-coder", "aquila", "gemma-4")]
SPACE = "\u2581"


def _real_file(name: str) -> Path:
    """The real models by their file names, llama.cpp's vocabularies by theirs (fetched once, cached)."""
    from real_files import real_file

    return real_file({SMOLLM: "smollm2", GEMMA: "gemma3"}.get(name, name.removesuffix(".gguf")))


TEXTS = [
    "", " ", "  ", "   ", "\n", "\t", "\n\n\n", " \n \n", "\r\n", "\t\t\n",
    "Hello world", " Hello world", "Hello, World! How's it going?",
    "Crème brûlée, naïve façade, Ångström", "Größe über Straße", "ñAb ÉCOLE éCOLE Écoute",
    "日本語の文章です。中文的句子。", "한국어 문장입니다", "Привет, как дела?", "Ελληνικά γράμματα",
    "مرحبا بك في العالم", "שלום לכולם", "emoji 🦙🚀👍🏽 family 👨\u200d👩\u200d👧 flag 🏳️\u200d🌈",
    "0 1 12 123 1234 12345 1234567 3.14159 -42 1,000,000 2024-01-31",
    "def add(a, b):\n    return a + b\n\nclass X:\n\tpass\n",
    "    four spaces\n        eight spaces\n\t\ttwo tabs", "a  b   c    d     e      f",
    "trailing spaces   ", "   leading spaces", "mixed \t\n whitespace \r\n runs  \n\n  end",
    "I'm sure they'll say it's what we've DONE; YOU'RE sure? 'S 'T", "CamelCaseWord snake_case SCREAMING_CASE mIxEd",
    "e\u0301 combining marks a\u0308", "\u00a0no-break\u2009thin\u3000ideographic\u0085next",
    '{"key": [1, 2, {"nested": null}]}', '<div class="x">&amp;</div>', "https://example.org/a?b=c&d=e#f",
    "$x^2 + y_1 \\leq 10$ `code` ~tilde | pipe", "!!! ??? ... ,,, ;;; ::: ---", "x = y != z <= w >= v",
    # special tokens written in the text
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", " <|im_start|> spaced <|im_end|> ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>inside<eos>",
    "<s>[INST] question [/INST]</s>",
    "text<|endoftext|>more<|endoftext|>", "a<|im_start|>b<|im_end|>c", "<unk> and <pad>", "<tool>call</tool>",
    "<table><tr><td>cell</td></tr></table>", "<|user|>\nhi<|end|>\n<|assistant|>\n",
]

_POOLS = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r   ",
          ".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`", "àéîõüñçßøåæÀÉÎÕÜÑÇ", "日本語中文한국어ひらがなカタカナ",
          "кириллицаΕλληνικά", "مرحباשלום", "🦙👍🏽🚀✨\u200d\ufe0f", "\u00a0\u2009\u3000\u0085\u200b\u2028",
          "\u0301\u0308\u0327", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢𐐀𐐨"]


def _random_texts(n: int, seed: int) -> list[str]:
    """Runs drawn from mixed pools: where letters, digits, spaces and scripts meet, the splits differ."""
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(_POOLS)) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def _metadata(path: Path) -> dict:
    """The file's metadata as the loader passes it (pagedchat's reader; gguf-py's, 20x slower, if absent)."""
    try:
        from pagedchat.model.gguf.reader import open_gguf
    except ImportError:
        import gguf

        return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    return open_gguf([path]).metadata


class _LlamaCpp:
    """The reference: llama.cpp's tokenizer through llama-cpp-python."""

    def __init__(self, path: Path):
        llama_cpp = pytest.importorskip("llama_cpp")
        self.lib = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llama.model)

    def encode(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.llama.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def text(self, ids: list[int], special: bool, strip_first_space: bool) -> str:
        """llama.cpp's pieces joined; with add_space_prefix, the first piece shown loses one leading space."""
        out = []
        for token in ids:
            buf = ctypes.create_string_buffer(256)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
            piece = buf.raw[:n]
            if piece and strip_first_space:
                piece, strip_first_space = piece.removeprefix(b" "), False
            out.append(piece)
        return b"".join(out).decode("utf-8", errors="replace")

    def end_of_generation(self) -> list[int]:
        n = self.lib.llama_vocab_n_tokens(self.vocab)
        return [i for i in range(n) if self.lib.llama_vocab_is_eog(self.vocab, i)]


def _assert_same_as_llama_cpp(path: Path, texts: list[str]) -> GGUFTokenizer:
    metadata = _metadata(path)
    tok, ref = load_gguf_tokenizer(metadata, str(path)), _LlamaCpp(path)
    strip = bool(metadata.get("tokenizer.ggml.add_space_prefix", metadata["tokenizer.ggml.model"] == "llama"))
    for text in texts:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == ref.encode(text, add), (text, add)
        ids = ref.encode(text, True)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.text(ids, not skip, strip), (text, skip)
    assert stop_token_ids(metadata, tok) == ref.end_of_generation()
    # control tokens left unparsed, user-defined ones still matched: llama.cpp's parse_special=False
    tok.backend_tokenizer.encode_special_tokens = True
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, False, parse_special=False), text
    tok.backend_tokenizer.encode_special_tokens = False
    return tok


@pytest.mark.parametrize("name", [SMOLLM, GEMMA, *LLAMA_CPP_VOCABS])
def test_real_file_matches_llama_cpp(name):
    path = _real_file(name)
    specials = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
                "<s>", "</s>", "<|end|>", "<|eot_id|>", "<turn|>", "<｜end▁of▁sentence｜>"}
    around = [f"{a}{s}{b}" for s in sorted(specials) for a, b in (("x", "y"), (" ", " "), ("\n", "hi"), ("", ""))]
    runs = [c * n for c in ("\n", " ", "\t") for n in (1, 2, 3, 7, 31, 32, 45)]
    _assert_same_as_llama_cpp(path, TEXTS + around + runs + _random_texts(300, seed=1))


# -- vocabularies trained here -------------------------------------------------------------------------------------
def _training_texts() -> list[str]:
    """The corpus without the special tokens' texts (a trained token must not spell one)."""
    texts = [t for t in TEXTS + _random_texts(400, seed=2) if "<" not in t]
    return texts * 3


def _write_gguf(path: Path, tokens: list[str], types: list[int], **keys) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, value in keys.items():
        if key == "merges":
            writer.add_token_merges(value)
        elif key == "scores":
            writer.add_token_scores(value)
        elif isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_string(key if "." in key else f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CONTROL, USER_DEFINED, NORMAL, UNKNOWN, BYTE = 3, 4, 1, 2, 6
BPE_SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<tool>", USER_DEFINED), ("</tool>", USER_DEFINED), ("   ", USER_DEFINED)]


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained with one word per text: its merges join letters, digits, spaces and
    punctuation across every boundary a pre-tokenizer might split at, so a split llama.cpp does not make (or
    misses) shows in the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trained.train_from_iterator(_training_texts(), trainers.BpeTrainer(
        vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model = json.loads(trained.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    tokens = [t for t, _ in BPE_SPECIALS] + learned
    types = [k for _, k in BPE_SPECIALS] + [NORMAL] * len(learned)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def _pre_names_to_check() -> list[str]:
    """One name per regex family, and the names whose flags differ within a family (ignore_merges, BOS)."""
    names = {}
    for name, family in gguf_tokenizer._PRE_NAMES.items():
        names.setdefault(family, name)
    return sorted({*names.values(), "llama-bpe", "dbrx", "glm4", "chatglm-bpe", "smollm", "command-r", "olmo"})


@pytest.mark.parametrize("pre", _pre_names_to_check())
def test_trained_byte_level_vocab_matches_llama_cpp(pre, byte_level_vocab, tmp_path):
    tokens, types, merges = byte_level_vocab
    path = _write_gguf(tmp_path / f"{pre}.gguf", tokens, types, model="gpt2", pre=pre, merges=merges,
                       eos_token_id=0, bos_token_id=1)
    _assert_same_as_llama_cpp(path, TEXTS + _random_texts(150, seed=3))


def test_every_pre_name_is_checked_through_its_family():
    """Names sharing a family share its regexes; each family is checked above by one of its names."""
    families = set(gguf_tokenizer._PRE_NAMES.values())
    assert families == set(gguf_tokenizer._REGEXES)
    assert {"default", "gpt-2", "llama3", "llama-bpe", "qwen2", "smollm", "tekken", "deepseek-llm", "falcon",
            "starcoder", "refact", "command-r", "olmo", "gpt-4o"} <= set(gguf_tokenizer._PRE_NAMES)


@pytest.fixture(scope="module")
def sentencepiece_vocab() -> tuple[list[str], list[float], list[str]]:
    """SentencePiece-style pieces (U+2581 for spaces) trained here, scored best-first by merge order (single
    characters score below every merge), and the merges."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    trained.train_from_iterator(_training_texts(), trainers.BpeTrainer(vocab_size=1200, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if len(t) == 1]
    pieces = list(dict.fromkeys(merged + chars))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return pieces, [-float(i) for i in range(len(pieces))], merges


@pytest.mark.parametrize("style", ["llama", "gemma", "phi-3"])
def test_trained_sentencepiece_vocab_matches_llama_cpp(style, sentencepiece_vocab, tmp_path):
    """Llama/Mistral style (a space before the text, and after every special token), Gemma style (none),
    Phi-3 (spaces after special tokens dropped, by the model's name): byte fallback for characters the pieces
    lack, control/user-defined/unknown tokens in the text."""
    pieces, scores, _ = sentencepiece_vocab
    specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<|user|>", CONTROL),
                ("<|end|>", CONTROL), ("<|assistant|>", CONTROL), ("<|endoftext|>", CONTROL), ("<tool>", USER_DEFINED),
                ("\t\t", USER_DEFINED)]   # llama.cpp refuses a Phi-3 vocabulary without <|endoftext|>
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [t for t, _ in specials] + byte_tokens + pieces
    types = [k for _, k in specials] + [BYTE] * 256 + [NORMAL] * len(pieces)
    all_scores = [0.0] * (len(specials) + 256) + scores
    name = {"phi-3": "Phi-3 mini"}.get(style, style)
    path = _write_gguf(tmp_path / f"{style}.gguf", tokens, types, model="llama", scores=all_scores,
                       add_space_prefix=style != "gemma", bos_token_id=1, eos_token_id=2, unknown_token_id=0,
                       **{"general.name": name})
    tok = _assert_same_as_llama_cpp(path, TEXTS + _random_texts(150, seed=4))
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]   # add_bos defaults on


@pytest.mark.parametrize("model, pre", [("gemma4", None), ("gpt2", "gemma4"), ("gpt2", "sarvam-moe")])
def test_trained_escaped_bpe_vocab_matches_llama_cpp(model, pre, sentencepiece_vocab, tmp_path):
    """Gemma 4's tokenizer: the file's merges over text with U+2581 for spaces, split into lines and newline
    runs, <0xNN> byte fallback; "gemma4" keeps a newline run that is a token whole and always adds BOS."""
    pieces, _, merges = sentencepiece_vocab
    specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
                ("<turn|>", CONTROL), ("<|turn>", CONTROL), ("<tool>", USER_DEFINED)]
    # newline runs up to 8 long, their merges ranked longest first as in Gemma 4's file: a longer run is merged
    # from the left into the longest runs, as the whole-run matching here splits it
    newline_runs = [n * "\n" for n in range(1, 9) if n * "\n" not in pieces]
    run_merges = [(n - 1) * "\n" + " \n" for n in range(8, 1, -1)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + pieces + newline_runs
    types = [k for _, k in specials] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(newline_runs))
    keys = {"pre": pre} if pre else {}
    path = _write_gguf(tmp_path / "g4.gguf", tokens, types, model=model, merges=run_merges + merges, bos_token_id=2,
                       eos_token_id=1, unknown_token_id=3, padding_token_id=0, add_space_prefix=False, **keys)
    runs = ["\n" * n for n in range(1, 20)] + ["a" + "\n" * n + "b" for n in (2, 5, 9, 12)]
    _assert_same_as_llama_cpp(path, TEXTS + runs + _random_texts(150, seed=5))


@pytest.mark.parametrize("extra", [
    ["<|eot_id|>", "<|eom_id|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<EOT>", "<end_of_turn>"],
    ["<|end|>", "<|return|>", "<|call|>", "<|channel|>", "<|message|>", "<|start|>"],   # gpt-oss
    ["</s>", "<|tool_response>", "<turn|>", "<eos>"],                                     # gemma4
    ["</s>", "<|im_end|>", "<fim_prefix>", "<PRE>", "[EOS]"],
])
def test_end_of_generation_and_kinds_by_text_match_llama_cpp(extra, byte_level_vocab, tmp_path):
    """llama.cpp decides by token text which tokens end generation and makes them control tokens (or, for a
    few, user-defined or ordinary): here they are ordinary tokens in the file."""
    tokens, types, merges = byte_level_vocab
    extra = [t for t in extra if t not in tokens]
    path = _write_gguf(tmp_path / "eog.gguf", tokens + extra, types + [NORMAL] * len(extra), model="gpt2",
                       pre="qwen2", merges=merges, eos_token_id=0)
    _assert_same_as_llama_cpp(path, TEXTS + [f"a{t}b {t}\n" for t in extra])


# -- the rest of the interface --------------------------------------------------------------------------------------
def test_chat_template_of_a_real_file():
    path = _real_file(SMOLLM)
    tok = load_gguf_tokenizer(_metadata(path), str(path))
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == _LlamaCpp(path).encode(text, False)
    assert stop_token_ids(_metadata(path), tok) == [0, 2, 4]   # <|endoftext|>, <|im_end|>, <reponame> (FIM repo)


def test_chat_template_variables_and_none(byte_level_vocab, tmp_path):
    tokens, types, merges = byte_level_vocab
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    path = _write_gguf(tmp_path / "t.gguf", tokens, types, model="gpt2", pre="qwen2", merges=merges,
                       bos_token_id=1, eos_token_id=2, **{"tokenizer.chat_template": template})
    tok = load_gguf_tokenizer(_metadata(path), str(path))
    rendered = tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False)
    assert rendered == "<|im_start|>[user]yo<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.bos_token) == (1, 2, "<|im_start|>")

    bare = _write_gguf(tmp_path / "bare.gguf", tokens, types, model="gpt2", pre="qwen2", merges=merges)
    tok = load_gguf_tokenizer(_metadata(bare), str(bare))
    assert tok.chat_template is None
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "yo"}])


def _tiny_metadata(**changes) -> dict:
    tokens = ["a", "b", "ab", "<|endoftext|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"], **changes}


@pytest.mark.parametrize("changes, words", [
    ({"tokenizer.ggml.pre": "no-such-pre"}, "unknown pre-tokenizer 'no-such-pre'"),
    ({"tokenizer.ggml.pre": "kimi-k2"}, "'kimi-k2'"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert'"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer vocabulary"),
    ({"tokenizer.ggml.merges": []}, "without merges"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a", "x"]}, "twice"),
    ({"tokenizer.ggml.token_type": [1]}, "token_type has 1 entries for 4 tokens"),
])
def test_what_cannot_be_read_is_one_line(changes, words):
    with pytest.raises(ModelLoadError) as failure:
        load_gguf_tokenizer(_tiny_metadata(**changes), "/models/x.gguf")
    message = str(failure.value)
    assert words in message and "/models/x.gguf" in message and "\n" not in message


def test_a_missing_pre_name_means_default():
    tok = load_gguf_tokenizer(_tiny_metadata(**{"tokenizer.ggml.pre": None}), "x.gguf")
    assert tok.encode("ab") == [2]   # llama.cpp's BPE default ids (11) are out of range: no BOS


def test_gemma_vocabulary_has_every_token():
    """Gemma's 262k SentencePiece tokens, merges derived from the scores (with numpy: the build time is in
    docs/benchmarks.md, not asserted here)."""
    path = _real_file(GEMMA)
    tok = load_gguf_tokenizer(_metadata(path), str(path))
    assert len(tok) == 262144
    assert tok.convert_ids_to_tokens(106) == "<end_of_turn>"


def test_streaming_decode_matches_decode(sentencepiece_vocab, tmp_path):
    """The engine streams text with the backend's DecodeStream: token by token it gives what decode gives,
    the first space taken back included."""
    from tokenizers.decoders import DecodeStream

    pieces, scores, _ = sentencepiece_vocab
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    path = _write_gguf(tmp_path / "s.gguf", tokens, types, model="llama", scores=[0.0] * 259 + scores)
    tok = load_gguf_tokenizer(_metadata(path), str(path))
    for text in ["Hello world, 日本語 🦙 and ñ", " leading space</s>", "x\n\n  y"]:
        ids = tok.encode(text)
        stream = DecodeStream(skip_special_tokens=True)
        streamed = "".join(stream.step(tok.backend_tokenizer, i) or "" for i in ids)
        assert streamed == tok.decode(ids, skip_special_tokens=True)


def test_no_transformers_import(byte_level_vocab, tmp_path):
    tokens, types, merges = byte_level_vocab
    path = _write_gguf(tmp_path / "n.gguf", tokens, types, model="gpt2", pre="llama3", merges=merges)
    code = ("import sys; from pagedchat.model.gguf.reader import open_gguf; "
            "from pagedchat.model.gguf.tokenizer import load_gguf_tokenizer; "
            f"t = load_gguf_tokenizer(open_gguf([__import__('pathlib').Path({str(path)!r})]).metadata, 'x'); "
            "t.encode('hi'); t.decode([5]); assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transformers_gguf_tokenizer_gives_the_same_ids():
    """transformers' own GGUF tokenizer of the same file (what libraries that take only a transformers
    tokenizer get: about 15 s to build) gives the same ids as ours, and so as llama.cpp's."""
    path = _real_file(SMOLLM)
    tok = load_gguf_tokenizer(_metadata(path), str(path))
    hf = tok.as_transformers()
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False), text
