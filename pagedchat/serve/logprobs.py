"""The engine's TokenLogprobs in OpenAI's two response shapes.

Chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}; with echo the
             prompt's tokens come first and the very first one has no score (null), as in OpenAI's API.
A completions `top_logprobs` entry also holds the chosen token (OpenAI: "up to logprobs + 1 elements"), which
is what lm-eval's greedy check compares against.
"""

from __future__ import annotations

from pagedchat.engine.core.logprobs import TokenLogprob


class TokenText:
    """Token id -> its text, memoized (the same few thousand ids come back again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(text: TokenText, entries: list[TokenLogprob], k: int) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:k]]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(text: TokenText, entries: list[TokenLogprob], offset: int,
                        echo_first: int | None = None) -> dict:
    """`offset`: characters of text before the first token. `echo_first`: the prompt's unscored first token,
    shown with null scores (echo only)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    if echo_first is not None:
        tokens.append(text(echo_first))
        logprobs.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(tokens[-1])
    for e in entries:
        token = text(e.token_id)
        tokens.append(token)
        logprobs.append(e.logprob)
        top = {text(t): lp for t, lp in e.top}
        top.setdefault(token, e.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged
