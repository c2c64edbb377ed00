"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from pagedchat.engine.sequence import Sequence


def decode_new_text(tokenizer, seq: Sequence) -> str:
    """Append the text of the newest output tokens to seq.text and return what was added."""
    if tokenizer is None:
        return ""
    ids = seq.output_ids
    prefix_offset, read_offset = seq.detok_offsets
    prefix = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[prefix_offset:], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        delta = full[len(prefix):]
        # The previous read window becomes the left context, so word-initial spaces decode right.
        seq.detok_offsets = (read_offset, len(ids))
        seq.text += delta
        return delta
    return ""
