"""The tokenizer of a GGUF file, built in memory for the `tokenizers` library, with llama.cpp's token ids.

A GGUF file carries its vocabulary as metadata (tokenizer.ggml.*), not as a tokenizer.json. llama.cpp is the
reference for what those keys mean, so this module rebuilds llama.cpp's tokenizer out of `tokenizers` parts:

- "gpt2" (byte-level BPE): the file's merges, and llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`, a list of
  regexes each splitting the pieces the ones before it left (`Split(..., "isolated")` does exactly that);
- "llama" (SentencePiece BPE): no pre-tokenizer, spaces as U+2581, and merges derived from the scores: llama.cpp
  (like sentencepiece) joins the adjacent pair whose joined text is the highest-scoring token, whatever the
  split, so every split of a token into two tokens is a merge, ranked by the joined token's score;
- "gemma4": the file's merges over text with U+2581 for spaces, split into lines and newline runs;
- control, user-defined and unknown tokens are added tokens, matched in the raw text before anything else;
  control and unknown ones are "special" (skip_special_tokens drops them). Their kinds are llama.cpp's: the
  file's token types after the corrections llama.cpp makes by token text (end-of-turn tokens become control
  tokens, ...).

Decoding joins llama.cpp's token pieces (what it prints while generating), taking back the space a SentencePiece
prefix added; llama_detokenize's optional clean-up of spaces before punctuation is not applied.

Nothing here imports transformers: `pagedchat run` on a GGUF starts without it. Libraries that need a
transformers tokenizer get `AutoTokenizer.from_pretrained(folder, gguf_file=name)`, built on first use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedchat.errors import ModelLoadError
from pagedchat.model.tokenizer import FastTokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"   # SentencePiece's visible space

# -- pre-tokenizers: `tokenizer.ggml.pre` -> llama.cpp's split regexes ------------------------------------------
# Each list is applied in order, every regex splitting the pieces the previous ones left (matches and the gaps
# between them both become pieces), then the pieces are byte-encoded. The regexes are the forms llama.cpp runs
# (ASCII case classes where the originals said (?i:...)); Oniguruma on the real text sees each codepoint's
# Unicode category as llama.cpp's category-collapsed text does. Where llama.cpp uses a hand-written splitter
# (gpt2, llama3, qwen2, qwen35, newline runs), the regex here is the one that splitter implements.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_NEWLINE_RUNS = r"[^\n]+|[\n]+"
# Non-ASCII characters are written as escapes: an editor's Unicode normalization would silently change a few
# (U+1F7D is canonically U+03CE, U+212A is "K") and with them the ranges.
_WORDS_BETWEEN_PUNCT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# llama.cpp runs regexes without \p{..} on text whose non-ASCII whitespace is replaced by "\v": a range spelled
# out in the regex (U+0800-U+4E00 holds U+3000, the ideographic space) never matches such whitespace there, so
# the ranges here leave it out (&&[^\s]).
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_HAN_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
_WIDE_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+"
_LATIN_GREEK_CYRILLIC = (  # deepseek-llm's letters, as explicit ranges
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")
_YOUTU_CJK = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
              "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+")
# "tekken" and "gpt-4o": a capitalised word is upper-case letters then lower-case ones, written with lookaheads
_UPPER_LOWER = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*")
_CJK_FIRST = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"

_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "jais2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
              + r"|\s{1,2}(?!\S)|\s{1}",),
    "qwen2": (_QWEN2,),
    "qwen35": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (r"[\r\n]", _LATIN_GREEK_CYRILLIC, _WIDE_PUNCT, r"\s+$", _HAN_HANGUL, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _HAN_HANGUL, r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", _HAN_KANA,
                    _CJK_FIRST + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "spark2_5": (r"\p{N}{1,3}", _HAN_KANA,
                 _CJK_FIRST + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"),
    # llama.cpp reads \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all as \p{L}: upper and lower case are one
    "youtu": (_YOUTU_CJK,
              r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
              r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*" + _CONTRACTIONS + "?"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "bloom": (_WORDS_BETWEEN_PUNCT,),
    "viking": (_WORDS_BETWEEN_PUNCT, r"\p{N}"),
    "tekken": (_UPPER_LOWER + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "chameleon": (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
    "gpt-4o": (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
               r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "granite-embed-multi": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "laguna": (_NEWLINE_RUNS, _QWEN2),
    "exaone-moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# `tokenizer.ggml.pre` names -> their regex family, as llama.cpp's vocabulary loader maps them.
_PRE_NAMES: dict[str, str] = {
    **dict.fromkeys(["default"], "default"),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
                     "trillion", "granite-docling", "exaone4"], "gpt2"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"], "qwen2"),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"], "starcoder"),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"], "deepseek-v3"),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt-4o"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "bloom"),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe"),
    **{name: name for name in ("falcon", "deepseek-llm", "deepseek-coder", "spark2_5", "youtu", "qwen35", "viking",
                               "tekken", "chameleon", "seed-coder", "ufakzeka", "laguna", "exaone-moe",
                               "minicpm5")},
    "jais-2": "jais2",
    "granite-embed-multi-97m": "granite-embed-multi",
}
# SentencePiece-like BPE (Gemma 4): the file's merges over text with U+2581 for spaces, in lines and newline runs,
# raw UTF-8 with <0xNN> byte tokens rather than byte-level characters. gemma4 keeps a newline run found whole in
# the vocabulary whole.
_ESCAPED_PRE = {"gemma4", "granite-embed-multi-311m", "sarvam-moe"}
_WHOLE_NEWLINE_RUNS = {"gemma4", "granite-embed-multi-311m"}
# llama.cpp knows these, but splits their text with hand-written code that no regex reproduces.
_UNSUPPORTED_PRE = {"kimi-k2", "afmoe", "tiny_aya", "cohere2moe", "superbpe", "whitespace"}
# Whole words found in the vocabulary are kept whole (llama.cpp's ignore_merges) ...
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "glm4", "glm5", "tekken", "youtu", "granite-embed-multi-97m", "minicpm5"}
# ... these add BOS unless the file says otherwise ...
_ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
            "jina-v5-nano", "tekken", "chameleon"}
# ... and these have no BOS unless the file names one.
_NO_BOS = {"chatglm-bpe", "glm4", "glm5"}

# -- llama.cpp's fix-ups by token text ---------------------------------------------------------------------------
# Tokens that end generation, whatever their type in the file (llama.cpp makes them control tokens).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}
# Fill-in-the-middle tokens, by the texts that stand for them when the file names no id; llama.cpp makes them
# control tokens, and pad, repo and file separator also end generation.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_ALWAYS_SHOWN = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}   # gpt-oss: never special
_LOOKED_UP = _EOG_TEXTS | _ALWAYS_SHOWN | {t for texts in _FIM_TEXTS.values() for t in texts}

# special token -> its tokenizer.ggml.* id keys (a later key wins: the deprecated FIM names come last)
_ID_KEYS = {"bos": ("bos",), "eos": ("eos",), "eot": ("eot",), "eom": ("eom",), "unk": ("unknown",),
            "sep": ("seperator",), "pad": ("padding",), "mask": ("mask",), "fim_pre": ("fim_pre", "prefix"),
            "fim_suf": ("fim_suf", "suffix"), "fim_mid": ("fim_mid", "middle"), "fim_pad": ("fim_pad",),
            "fim_rep": ("fim_rep",), "fim_sep": ("fim_sep",)}
_TOKEN_NAMES = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token",
                "sep": "sep_token", "mask": "mask_token"}


# -- the public face -------------------------------------------------------------------------------------------
class GGUFTokenizer(FastTokenizer):
    """pagedchat's light tokenizer over a GGUF vocabulary: FastTokenizer's calls, llama.cpp's ids."""

    def __init__(self, source: str, backend, special_tokens: dict[str, str], chat_template: str | None,
                 eog_token_ids: list[int]):
        super().__init__(Path(source), backend, special_tokens, chat_template, clean_up_spaces=False)
        self.eog_token_ids = eog_token_ids

    def _transformers(self):
        """transformers reads the same file (slowly: it converts the whole vocabulary), for libraries that
        take only a transformers tokenizer."""
        if self._hf is None:
            from transformers import AutoTokenizer

            path = Path(self.name_or_path)
            self._hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self._hf.chat_template = self.chat_template
        return self._hf


def load_gguf_tokenizer(metadata: dict[str, object], source: str, light: bool = False) -> GGUFTokenizer:
    """The tokenizer and chat template of a GGUF file from its metadata (GGUF key -> value); `source` is the
    file's path. ModelLoadError for a vocabulary llama.cpp would refuse or this cannot reproduce.

    light: a SentencePiece vocabulary gets the pure-Python backend of spm.py (the same ids and text, built in
    milliseconds instead of seconds, without the `tokenizers` package); other vocabularies are unaffected."""
    vocab = _Vocab(metadata, source)
    special = {_TOKEN_NAMES[k]: vocab.tokens[i] for k, i in vocab.ids.items() if k in _TOKEN_NAMES and i is not None}
    template = metadata.get("tokenizer.chat_template")
    if light and vocab.style == "sentencepiece":
        from pagedchat.model.gguf.spm import SentencePieceBackend

        backend = SentencePieceBackend(vocab)
    else:
        backend = _backend(vocab)
    return GGUFTokenizer(source, backend, special, template if isinstance(template, str) else None, vocab.eog)


def stop_token_ids(metadata: dict[str, object], tokenizer) -> list[int]:
    """The tokens that end a reply, as llama.cpp decides them for this vocabulary: EOS, EOT, EOM, the
    fill-in-the-middle pad/repo/separator tokens and every token whose text marks an end of turn."""
    eog = getattr(tokenizer, "eog_token_ids", None)
    return list(eog) if eog is not None else _Vocab(metadata, str(getattr(tokenizer, "name_or_path", ""))).eog


def _key(name: str) -> str:
    return f"tokenizer.ggml.{name}"


# -- the vocabulary as llama.cpp sees it -------------------------------------------------------------------------
class _Vocab:
    """tokenizer.ggml.* read with llama.cpp's defaults and its fix-ups by token text."""

    def __init__(self, metadata: dict[str, object], source: str):
        self.source = source
        self.model = str(metadata.get(_key("model"), ""))
        if self.model not in ("gpt2", "llama", "gemma4"):
            raise ModelLoadError(f"{source}: tokenizer model {self.model!r} is not supported (GGUF vocabularies "
                                 f"of 'gpt2' byte-level BPE, 'llama' SentencePiece and 'gemma4' are)")
        self.pre = self._pre_name(metadata)
        # how text becomes tokens: "sentencepiece" (merges from scores), "escaped" (U+2581 for spaces, the
        # file's merges) or "byte-level" (the file's merges over GPT-2's byte alphabet)
        self.style = {"llama": "sentencepiece", "gemma4": "escaped"}.get(self.model) \
            or ("escaped" if self.pre in _ESCAPED_PRE else "byte-level")
        self.tokens = _token_texts(metadata, source)
        self.index = dict(zip(self.tokens, range(len(self.tokens))))
        if len(self.index) != len(self.tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.tokens holds a token text twice")
        n = len(self.tokens)
        self.kinds = _array(metadata, "token_type", n, NORMAL, np.int32, source)
        self.scores = _array(metadata, "scores", n, 0.0, np.float32, source)
        self.merges = metadata.get(_key("merges"))
        if self.model != "llama" and not self.merges:
            raise ModelLoadError(f"{source}: a {self.model!r} vocabulary without merges (tokenizer.ggml.merges)")
        self.ids = self._special_ids(metadata)
        spm = self.model == "llama"
        self.add_bos = _flag(metadata, "add_bos_token", spm or self.pre in _ADD_BOS) \
            or self.pre in _WHOLE_NEWLINE_RUNS   # llama.cpp adds BOS to Gemma 4 prompts whatever the file says
        self.add_eos = _flag(metadata, "add_eos_token", False)
        self.add_space_prefix = _flag(metadata, "add_space_prefix", spm)
        self.eog = self._fix_up_by_text()
        self.rstrip = self._rstrip_ids(metadata)

    def _pre_name(self, metadata) -> str:
        if self.model == "gemma4":
            return "gemma4"
        if self.model == "llama":
            return "default"   # SentencePiece splits nothing before merging
        pre = str(metadata.get(_key("pre")) or "default")   # as in llama.cpp, a missing name means "default"
        if pre in _ESCAPED_PRE:
            return pre
        if pre in _UNSUPPORTED_PRE:
            raise ModelLoadError(f"{self.source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: "
                                 f"llama.cpp splits its text with code no regex reproduces")
        if pre not in _PRE_NAMES:
            raise ModelLoadError(f"{self.source}: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
        return pre

    def _special_ids(self, metadata) -> dict[str, int | None]:
        """llama.cpp's default ids for the vocabulary type, replaced by the file's where they are in range."""
        n = len(self.tokens)
        ids: dict[str, int | None] = dict.fromkeys(_ID_KEYS)
        ids.update({"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}.get(self.model, {}))
        if self.pre in _NO_BOS:
            ids["bos"] = None
        ids = {k: v if v is None or v < n else None for k, v in ids.items()}
        for name, keys in _ID_KEYS.items():
            for key in keys:
                value = metadata.get(_key(f"{key}_token_id"))
                if isinstance(value, int) and 0 <= value < n:
                    ids[name] = value
        return ids

    def _fix_up_by_text(self) -> list[int]:
        """Token kinds llama.cpp corrects by text, and the end-of-generation (EOG) set it gathers: the known
        end-of-turn texts, fill-in-the-middle pad/repo/separator, EOS, EOT and EOM. Returns the EOG ids."""
        found = {t: self.index[t] for t in _LOOKED_UP if t in self.index}
        for name, texts in _FIM_TEXTS.items():
            candidates = [found[t] for t in texts if t in found]
            if self.ids[name] is None and candidates:
                self.ids[name] = min(candidates)   # llama.cpp takes the first its hash map yields: one of them
                self.kinds[self.ids[name]] = CONTROL
        eog = {self.ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if self.ids[k] is not None}
        for text in _EOG_TEXTS & found.keys():
            eog.add(found[text])
            self.kinds[found[text]] = CONTROL
        for text in _ALWAYS_SHOWN & found.keys():
            self.kinds[found[text]] = USER_DEFINED
        eog |= {self.ids[k] for k in ("eos", "eot", "eom") if self.ids[k] is not None}
        in_eog = {self.tokens[i]: i for i in eog}
        # gpt-oss and solar-open: "<|end|>" ends a message, not the reply, where call and return tokens exist
        if "<|end|>" in in_eog and in_eog.keys() & {"<|call|>", "<|calls|>"} \
                and in_eog.keys() & {"<|return|>", "<|flush|>"}:
            eog.discard(in_eog["<|end|>"])
            self.kinds[in_eog["<|end|>"]] = USER_DEFINED
        # gemma4 and plamo: "</s>" is an ordinary token there
        if "</s>" in in_eog and in_eog.keys() & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(in_eog["</s>"])
            self.kinds[in_eog["</s>"]] = NORMAL
        return sorted(eog)

    def _rstrip_ids(self, metadata) -> set[int]:
        """Phi-3 (by general.name): llama.cpp drops the whitespace after most special tokens."""
        name = str(metadata.get("general.name", "")).lower()
        if "phi-3" not in name and "phi3" not in name:
            return set()
        kept = {self.index.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        return ({*self.special_token_ids(), self.index.get("</s>")} - kept) - {None}

    def special_token_ids(self) -> list[int]:
        """Tokens llama.cpp matches in the text before tokenizing the rest: control, user-defined, unknown."""
        return np.flatnonzero(np.isin(self.kinds, (CONTROL, USER_DEFINED, UNKNOWN))).tolist()


def _token_texts(metadata, source: str) -> list[str]:
    tokens = metadata.get(_key("tokens"))
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ModelLoadError(f"{source} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    # llama.cpp renames empty tokens, so that every text names one token
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _array(metadata, name: str, n: int, default, dtype, source: str) -> np.ndarray:
    value = metadata.get(_key(name))
    if value is None:
        return np.full(n, default, dtype=dtype)
    value = np.asarray(value, dtype=dtype)
    if len(value) < n:
        raise ModelLoadError(f"{source}: tokenizer.ggml.{name} has {len(value)} entries for {n} tokens")
    return value[:n].copy()


def _flag(metadata, name: str, default: bool) -> bool:
    value = metadata.get(_key(name))
    return default if value is None else bool(value)


# -- the `tokenizers` pipeline -----------------------------------------------------------------------------------
def _backend(vocab: _Vocab):
    from tokenizers import Tokenizer

    if vocab.style == "byte-level":
        tokenizer = Tokenizer(_file_merges_bpe(vocab))
        _byte_level_steps(tokenizer, vocab)
    elif vocab.style == "escaped":
        tokenizer = Tokenizer(_file_merges_bpe(vocab))
        _escaped_steps(tokenizer, vocab)
    else:
        tokenizer = Tokenizer(_sentencepiece_bpe(vocab))
        _sentencepiece_steps(tokenizer, vocab)
    _add_special_tokens(tokenizer, vocab)
    tokenizer.post_processor = _bos_eos(vocab)
    return tokenizer


def _file_merges_bpe(vocab: _Vocab):
    """BPE over the file's "left right" merges, ranked by position (a repeated merge keeps its first rank, as in
    llama.cpp). Escaped text falls back to <0xNN> byte tokens where no token covers a character."""
    from tokenizers.models import BPE

    lines = list(dict.fromkeys(vocab.merges))
    options = dict(vocab=vocab.index, ignore_merges=vocab.pre in _IGNORE_MERGES, byte_fallback=vocab.style == "escaped")
    try:   # the converters' files: every merge joins two tokens into a token
        return BPE(merges=[tuple(line.split(" ", 1)) for line in lines], **options)
    except Exception:   # `tokenizers` refuses a merge with a text outside the vocabulary
        return BPE(merges=_merges_of_tokens(lines, vocab.index), **options)


def _merges_of_tokens(lines: list[str], index: dict[str, int]) -> list[tuple[str, str]]:
    """The merges as llama.cpp reads them (a token may begin with a space: the separator is the first space
    after the first character), without those outside the vocabulary: they could never make a token."""
    merges = []
    for line in lines:
        at = line.find(" ", 1)
        left, right = line[:at], line[at + 1:]
        if at > 0 and left in index and right in index and left + right in index:
            merges.append((left, right))
    return merges


def _sentencepiece_bpe(vocab: _Vocab):
    """BPE whose merges are every split of a token into two tokens, ranked by the joined token's score.
    Characters outside the vocabulary become the <0xNN> tokens of their UTF-8 bytes, as in llama.cpp."""
    from tokenizers.models import BPE

    unk = vocab.tokens[vocab.ids["unk"]] if vocab.ids["unk"] is not None else None
    return BPE(vocab=vocab.index, merges=_score_merges(vocab.tokens, vocab.scores), unk_token=unk,
               byte_fallback=True)


def _byte_level_steps(tokenizer, vocab: _Vocab) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _REGEXES[_PRE_NAMES[vocab.pre]]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    rewrites = [decoders.Replace(text, spelling) for text, spelling in _byte_level_spellings(vocab).items()]
    tokenizer.decoder = _decoder(vocab, [*rewrites, decoders.ByteLevel()])


def _sentencepiece_steps(tokenizer, vocab: _Vocab) -> None:
    from tokenizers import decoders, normalizers

    # llama.cpp puts the space before every stretch of text between special tokens, not only the first
    prefix = [normalizers.Prepend(SPACE)] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = _decoder(vocab, [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def _escaped_steps(tokenizer, vocab: _Vocab) -> None:
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_NEWLINE_RUNS), behavior="isolated")
    tokenizer.decoder = _decoder(vocab, [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    if vocab.pre in _WHOLE_NEWLINE_RUNS:
        # llama.cpp keeps a newline run that is a token whole (no merges). Matching those tokens first, like
        # user-defined ones, does that (a newline run is a piece of its own anyway). A longer run is cut into the
        # longest runs from the left, where llama.cpp merges it: the same where the merges rank longer runs
        # first, as Gemma 4's do (checked to 90 newlines)
        runs = [t for t, kind in zip(vocab.tokens, vocab.kinds.tolist()) if kind == NORMAL and not t.strip("\n")]
        tokenizer.add_tokens([AddedToken(t, normalized=False) for t in runs])


def _decoder(vocab: _Vocab, steps: list):
    """llama.cpp's detokenizer takes back the space the prefix added: one, from the first token shown."""
    from tokenizers import decoders

    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))


def _add_special_tokens(tokenizer, vocab: _Vocab) -> None:
    """Control and unknown tokens are special (skip_special_tokens drops them); user-defined ones are matched
    the same way but decode as their text. All are matched in the raw text, before any normalization."""
    from tokenizers import AddedToken

    special, shown = [], []
    for i in vocab.special_token_ids():
        is_special = vocab.kinds[i] != USER_DEFINED
        token = AddedToken(vocab.tokens[i], special=is_special, normalized=False, rstrip=i in vocab.rstrip)
        (special if is_special else shown).append(token)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(shown)


def _bos_eos(vocab: _Vocab):
    from tokenizers import processors

    template, tokens = ["$A"], []
    for name, add in (("bos", vocab.add_bos), ("eos", vocab.add_eos)):
        token_id = vocab.ids[name]
        if add and token_id is not None:
            # the template names the token by a key of ours: a token's own text may not parse as a name
            template.insert(0 if name == "bos" else len(template), name)
            tokens.append({"id": name, "ids": [token_id], "tokens": [vocab.tokens[token_id]]})
    return processors.TemplateProcessing(single=template, special_tokens=tokens)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the 68 others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + n) for n, b in enumerate(others)}}


def _byte_level_spellings(vocab: _Vocab) -> dict[str, str]:
    """Control and user-defined tokens whose text the byte-level decoder would misread -> the byte-level
    spelling of that text.

    llama.cpp shows these tokens as written, but the decoder reads every token as byte-level characters where
    it can: DeepSeek Coder's user-defined "ö" means "ö", not the byte 0xF6. Rewriting "ö" to its spelling "Ã¶"
    before the decoder is safe where no other token contains "ö": where one of its characters is in no ordinary
    token (there the bytes that UTF-8 never uses stand). Other such tokens stay as the decoder reads them."""
    byte_to_char = _byte_to_char()
    char_to_byte = {c: b for b, c in byte_to_char.items()}
    shown = [vocab.tokens[i] for i in vocab.special_token_ids()]
    misread = [t for t in shown if all(c in char_to_byte for c in t) and bytes(map(char_to_byte.get, t)) != t.encode()]
    if not misread:
        return {}
    ordinary = set("".join(t for t, kind in zip(vocab.tokens, vocab.kinds.tolist()) if kind == NORMAL))
    return {t: "".join(byte_to_char[b] for b in t.encode()) for t in misread
            if not set(t) <= ordinary and sum(t in other for other in shown) == 1}


# -- SentencePiece merges from scores ----------------------------------------------------------------------------
def _score_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, as a merge, best joined score first (ties in token order).

    Gemma's 262k tokens have 1.2M splits: they are matched against the vocabulary with numpy, by polynomial
    hashes of both sides of every split, not by a Python loop over the splits."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    starts = np.concatenate(([0], np.cumsum(lengths)))
    text_hash = _substring_hasher("".join(tokens))
    token_hash = text_hash(starts[:-1], starts[1:])
    order = np.argsort(token_hash)
    sorted_hash = token_hash[order]
    # one row per split: the token, and where its text is cut
    splits = np.maximum(lengths - 1, 0)
    token = np.repeat(np.arange(len(tokens)), splits)
    cut = starts[token] + 1 + np.arange(len(token)) - np.repeat(np.cumsum(splits) - splits, splits)
    left = _find(sorted_hash, order, text_hash(starts[token], cut))
    right = _find(sorted_hash, order, text_hash(cut, starts[token + 1]))
    # a hash collision would also have to give both sides the right lengths: check those, it costs nothing
    found = (left >= 0) & (right >= 0) & (lengths[left] == cut - starts[token]) \
        & (lengths[right] == starts[token + 1] - cut)
    token, left, right = token[found], left[found], right[found]
    rank = np.argsort(-scores[token], kind="stable")
    text = tokens.__getitem__
    return list(zip(map(text, left[rank].tolist()), map(text, right[rank].tolist())))


def _substring_hasher(text: str):
    """hash(a, b) of text[a:b] for arrays of bounds, in O(1) each: sum(c[j] * P**(j - a)) mod 2**64, from the
    prefix sums of c[j] * P**j and the powers of P's inverse (P is odd, so it has one mod 2**64)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + 1   # no zero codes
    p = 0x9E3779B97F4A7C15
    one, zero = np.ones(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)   # uint64 throughout, never a float
    with np.errstate(over="ignore"):
        powers = np.concatenate((one, np.cumprod(np.full(len(codes) - 1, p, dtype=np.uint64))))
        inverse = np.concatenate((one, np.cumprod(np.full(len(codes), pow(p, -1, 1 << 64), dtype=np.uint64))))
        prefix = np.concatenate((zero, np.cumsum(codes * powers, dtype=np.uint64)))

    def text_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return (prefix[b] - prefix[a]) * inverse[a]

    return text_hash


def _find(sorted_hash: np.ndarray, order: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """The token with each hash, or -1; searched in sorted order, several times faster than in any order."""
    by_hash = np.argsort(hashes)
    at = np.empty(len(hashes), dtype=np.int64)
    at[by_hash] = np.searchsorted(sorted_hash, hashes[by_hash])
    at = np.minimum(at, len(sorted_hash) - 1)
    return np.where(sorted_hash[at] == hashes, order[at], -1)
