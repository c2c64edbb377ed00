"""Chat-template rendering: messages -> the token ids the model sees (the one place templates are applied
to a whole conversation; chat/turns.py renders one new turn at a time from these)."""

from __future__ import annotations

from pagedchat.errors import UserError


def chat_prompt_ids(engine, user: str, system: str | None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of [system?, user] rendered by the model's chat template, ready for the reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_chat(engine, messages, template_kwargs)


def render_chat(engine, messages: list[dict], template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        raise UserError(f"model {engine.model_path} has no tokenizer")
    if not getattr(tok, "chat_template", None):
        raise UserError(f"model {engine.model_path} has no chat template; use --raw or set chat_template "
                        f"in models.toml")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      **(template_kwargs or {}))
    except Exception as e:  # jinja errors: a broken template, or one that refuses these messages
        raise UserError(f"the chat template of {engine.model_path} failed: {str(e).splitlines()[0]} "
                        f"(fix it, or use --raw)") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def require_text(text: str | None, what: str = "prompt") -> str:
    """The one check for an empty message or prompt (blank counts as empty), before any tokenizing; the
    engine's EmptyPrompt then only guards token-id prompts."""
    if not text or not text.strip():
        raise UserError(f"the {what} is empty")
    return text
