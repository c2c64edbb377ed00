"""A model folder's tokenizer without transformers: tokenizer.json through the `tokenizers` library and the
chat template through jinja2, with transformers' template semantics (tests compare both with transformers).

`import transformers` costs seconds; a one-shot `pagedchat run` answers in less. Folders this cannot
reproduce exactly (slow/sentencepiece-only tokenizers, tokenizer classes that rebuild the post-processor,
remote code, named template sets) load transformers' AutoTokenizer instead. Anything pagedchat's own code
does not use is forwarded to a transformers tokenizer built on first use, so callers lose nothing.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

# Classes whose tokenizer.json is the whole truth (transformers adds nothing of its own on top).
_PLAIN_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_fast_tokenizer(model_dir: Path) -> "FastTokenizer | None":
    """The light tokenizer for this folder, or None when only transformers can load it faithfully."""
    tok_file, cfg_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tok_file.is_file():
        return None
    try:
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        legacy = model_dir / "special_tokens_map.json"
        specials = json.loads(legacy.read_text()) if legacy.is_file() else {}
    except (OSError, ValueError):
        return None
    if (config.get("tokenizer_class") not in _PLAIN_CLASSES or "auto_map" in config
            or config.get("add_bos_token") or config.get("add_eos_token")):
        return None
    template = config.get("chat_template")
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text()
    if template is not None and not isinstance(template, str):
        return None  # a list of named templates: transformers picks among them
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(tok_file))
    except Exception:
        return None  # transformers reports what is wrong with the file
    tokens = {k: _content(specials.get(k)) for k in _SPECIAL}
    tokens.update({k: _content(config[k]) for k in _SPECIAL if k in config})
    return FastTokenizer(model_dir, backend, {k: v for k, v in tokens.items() if v is not None}, template,
                         bool(config.get("clean_up_tokenization_spaces", False)))


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class FastTokenizer:
    """What pagedchat calls on a transformers fast tokenizer, over a `tokenizers.Tokenizer`."""

    def __init__(self, model_dir: Path, backend, special_tokens: dict[str, str], chat_template: str | None,
                 clean_up_spaces: bool):
        self.name_or_path = str(model_dir)
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_spaces
        self._hf = None

    # -- special tokens -------------------------------------------------------------------------------------
    def _token(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _token_id(self, name: str) -> int | None:
        token = self._token(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids ---------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        assert isinstance(text, str), "one text at a time (batches go through transformers)"
        return SimpleNamespace(input_ids=self.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # -- chat template --------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools=None, documents=None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """The rendered conversation (tokenize=False) or its ids, encoded without special tokens as
        transformers does; options this renderer does not implement go to transformers."""
        if kwargs.keys() & {"continue_final_message", "return_assistant_tokens_mask", "chat_template",
                            "padding", "truncation", "max_length", "return_tensors"} \
                or not _is_one_chat(conversation):
            return self._transformers().apply_chat_template(conversation, tools=tools, documents=documents,
                                                            add_generation_prompt=add_generation_prompt,
                                                            tokenize=tokenize, **kwargs)
        kwargs.pop("return_dict", None)
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = render_chat_template(self.chat_template, conversation, tools, documents, add_generation_prompt,
                                    {**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- everything else ------------------------------------------------------------------------------------
    def as_transformers(self):
        """The transformers tokenizer of the same folder, for libraries that take only that (llguidance),
        built on first use: the start-up path of `run` never pays for it."""
        return self._transformers()

    def _transformers(self):
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
        self._hf.chat_template = self.chat_template  # models.toml may have replaced it
        return self._hf

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_hf":
            raise AttributeError(name)
        return getattr(self._transformers(), name)


def _is_one_chat(conversation) -> bool:
    return isinstance(conversation, (list, tuple)) and all(isinstance(m, dict) for m in conversation)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and common English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# -- the renderer -------------------------------------------------------------------------------------------
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(template: str, messages: list[dict], tools, documents, add_generation_prompt: bool,
                         variables: dict) -> str:
    """Render one conversation the way transformers' apply_chat_template does (tokenize=False)."""
    return _compile(template).render(messages=[_with_reasoning_aliases(m) for m in messages], tools=tools,
                                     documents=documents, add_generation_prompt=add_generation_prompt,
                                     **variables)


def _with_reasoning_aliases(message: dict) -> dict:
    """Templates read a reply's reasoning under different names: offer it under each, as transformers does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def _compile(template: str):
    """A sandboxed environment with the options and helpers Hub templates are written against: trimmed
    blocks, loop controls, a `{% generation %}` block, non-ASCII-preserving tojson, raise_exception,
    strftime_now."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_block_class(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=1)
def _generation_block_class():
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; when
        only rendering, it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock
