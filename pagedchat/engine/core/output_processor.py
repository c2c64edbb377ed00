"""From sampled token to what the caller sees: detokenizing, finish rules (EOS, stop ids, stop strings,
length) and holding back text that could still become a stop string. Touches one sequence at a time; the
engine does the bookkeeping (finishing, pins) with the reason it returns."""

from __future__ import annotations

from pagedchat.engine.core.detokenizer import decode_new_text
from pagedchat.engine.core.sequence import Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int) -> str | None:
        """Add one sampled token to seq (ids and text); the finish reason it causes: stop, length or None.
        A stop string found in the new text is cut off, with everything after it."""
        params = seq.request.params
        seq.token_ids.append(token)
        shown = len(seq.text)
        decode_new_text(self.tokenizer, seq)
        if seq.matcher is not None:
            accepted = seq.matcher.consume_token(token)
            assert accepted, f"a masked token was refused by the grammar: {seq.matcher.get_error()}"
        if not params.ignore_eos and token in self.eos_token_ids or token in params.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"             # the grammar is complete: nothing more may follow
        if self._cut_at_stop_string(seq, shown):
            return "stop"
        return "length" if self.ends_by_length(seq) else None

    def ends_by_length(self, seq: Sequence) -> bool:
        """Whether seq's tokens reach its max_tokens or the model's context (known before the last token is)."""
        return seq.num_output_tokens >= seq.request.params.max_tokens or seq.num_tokens >= self.max_model_len

    def take_visible(self, seq: Sequence, finished: bool) -> str:
        """The text not streamed yet, less what could still turn out to be the start of a stop string."""
        stops = seq.request.params.stop
        held = 0 if finished or not stops else max(len(s) for s in stops) - 1
        visible = max(seq.emitted, len(seq.text) - held)
        text, seq.emitted = seq.text[seq.emitted:visible], visible
        return text

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, shown: int) -> bool:
        stops = seq.request.params.stop
        if not stops:
            return False
        window_start = max(0, shown - max(len(s) for s in stops))
        cut = min((i for i in (seq.text.find(s, window_start) for s in stops) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.text = seq.text[:cut]
        return True
