"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from pagedchat.engine.core.sequence import Sequence


def decode_new_text(tokenizer, seq: Sequence) -> str:
    """Append the text of the newest output token to seq.text and return what was added."""
    if tokenizer is None:
        return ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _streams(backend):
        delta = _stream_step(backend, seq)
    else:
        delta = _window_step(tokenizer, seq)
    seq.text += delta
    return delta


def _streams(backend) -> bool:
    """A `tokenizers` Tokenizer decodes a stream itself; another backend (model/gguf/spm.py's, built without that
    library) is read by windows through the tokenizer's decode."""
    return backend is not None and type(backend).__module__.partition(".")[0] == "tokenizers"


def _stream_step(backend, seq: Sequence) -> str:
    """Fast tokenizers: one Rust call per token, holding back incomplete UTF-8 itself."""
    from tokenizers.decoders import DecodeStream

    if seq.detok_stream is None:
        seq.detok_stream = DecodeStream(skip_special_tokens=True)
        pending = seq.output_ids  # a stream started late (never in practice) catches up
    else:
        pending = seq.output_ids[-1:]
    text = ""
    for token in pending:
        text += seq.detok_stream.step(backend, token) or ""
    return text


def _window_step(tokenizer, seq: Sequence) -> str:
    """Slow tokenizers: decode a short window twice and keep the difference."""
    ids = seq.output_ids
    prefix_offset, read_offset = seq.detok_offsets
    prefix = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[prefix_offset:], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        # The previous read window becomes the left context, so word-initial spaces decode right.
        seq.detok_offsets = (read_offset, len(ids))
        return full[len(prefix):]
    return ""
