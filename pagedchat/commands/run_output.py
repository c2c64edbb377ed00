"""What `pagedchat run` writes. stdout holds the replies and nothing else (a pipe gets the pure text); what a
reader must know about them (cut at the length limit, variants that came out identical, Ctrl-C) is one line
each on stderr.

    LiveReply      one prompt's reply streamed as it is generated; with -n, variant 1 streams and every
                   other variant is printed as soon as it finishes
    print_plain    a --file batch or beam hypotheses, printed once done
    json_report    the --json object (DESIGN.md's fields, with each prompt's token ids)
    notes          the stderr lines
"""

from __future__ import annotations

import sys

from pagedchat.reasoning import ReasoningStream
from pagedchat.reasoning import split as split_reasoning
from pagedchat.settings import kv_report
from pagedchat.words import cut_mark, for_stdout, for_terminal


def note(message: str) -> None:
    print(f"pagedchat: note: {message}", file=sys.stderr)


class ReasoningShown:
    """Streams a reply to stdout: the answer as it comes; reasoning (<think>...</think>) dim on a terminal
    and left out when stdout is a pipe (scripts get the answer; --json has the reasoning in its own field)."""

    def __init__(self, thinking: bool):
        self.stream = ReasoningStream(thinking)
        self.tty = sys.stdout.isatty()

    def write(self, text: str, raw: bool = False) -> None:
        pieces = [("answer", text)] if raw else self.stream.feed(text)
        self._show(pieces)

    def close(self) -> None:
        self._show(self.stream.flush())

    def _show(self, pieces) -> None:
        for kind, text in pieces:
            if kind == "answer":
                sys.stdout.write(for_terminal(text) if self.tty else text)
            elif self.tty:
                sys.stdout.write(f"\x1b[2m{for_terminal(text)}\x1b[0m")
        sys.stdout.flush()


class LiveReply:
    """One prompt's n variants on stdout while they are generated. Variant 1 streams (under a `--- variant 1
    ---` header when n > 1); each other variant is printed whole, under its header, once it has finished and
    variant 1 is done. `thinking`: whether the reply starts inside <think> (None: --raw, no reasoning split)."""

    def __init__(self, n: int, thinking: bool | None):
        self.n, self.thinking = n, thinking
        self.shown = ReasoningShown(bool(thinking))
        self.texts = [""] * n
        self.reasons: dict[int, str | None] = {}   # variants finished, in the order they did, and why
        self.printed: set[int] = set()
        self.started = self.first_done = False

    def feed(self, index: int, text: str, finish_reason: str | None = None) -> None:
        """New text of variant `index` (and, on its last piece, why it ended)."""
        if index >= self.n:
            return
        self.texts[index] += text
        if index == 0 and text:
            self._start_first()
            self.shown.write(text, raw=self.thinking is None)
        if finish_reason is not None and index not in self.reasons:
            self.reasons[index] = finish_reason
            if index == 0:
                self._end_first(finish_reason)
            if self.first_done:     # while variant 1 streams, the others wait for it
                for done in self.reasons:
                    if done not in self.printed:
                        self._print_variant(done, self.reasons[done])

    def finish(self, output) -> None:
        """The request is over (done, failed or interrupted): what has not been printed yet is, in order."""
        if not self.first_done:
            self._end_first(output.outputs[0].finish_reason if output.outputs else None)
        for variant in output.outputs:
            if variant.index not in self.printed:
                self.texts[variant.index] = variant.text
                self._print_variant(variant.index, variant.finish_reason)

    def _start_first(self) -> None:
        if not self.started and self.n > 1:
            _header("variant 1")
        self.started = True

    def _end_first(self, finish_reason: str | None) -> None:
        self._start_first()
        self.shown.close()
        sys.stdout.write(cut_mark(finish_reason) + "\n")
        sys.stdout.flush()
        self.first_done = True
        self.printed.add(0)

    def _print_variant(self, index: int, finish_reason: str | None) -> None:
        _header(f"variant {index + 1}")
        text = self.texts[index] if self.thinking is None else split_reasoning(self.texts[index], self.thinking)[1]
        print(for_stdout(text) + cut_mark(finish_reason))
        sys.stdout.flush()
        self.printed.add(index)


def _header(label: str) -> None:
    print(f"--- {label} ---")


def print_plain(outputs, batch: bool, thinking) -> None:
    """A --file batch (each prompt's outputs under `--- prompt K ---`) or beam hypotheses, once done."""
    for i, out in enumerate(outputs):
        for variant in out.outputs:
            labels = ([f"prompt {i + 1}"] if batch else []) + ([variant_label(variant)]
                                                              if len(out.outputs) > 1 or variant.score is not None
                                                              else [])
            if labels:
                _header(" / ".join(labels))
            text = variant.text if thinking is None else split_reasoning(variant.text, thinking[i])[1]
            print(for_stdout(text) + cut_mark(variant.finish_reason))


def variant_label(variant) -> str:
    if variant.score is None:
        return f"variant {variant.index + 1}"
    return f"beam {variant.index + 1} (score {variant.score:.4f})"


# -- the stderr notes ----------------------------------------------------------------------------------------------
def length_note(outputs, max_tokens: list[int], max_model_len: int | None, batch: bool) -> str | None:
    """One line naming the replies cut at the length limit and the limit that cut them (for a pipe: on a
    terminal the reply itself ends with a dim [length]). max_tokens: each prompt's own limit."""
    cut = [(i, v) for i, out in enumerate(outputs) for v in out.outputs if v.finish_reason == "length"]
    if not cut:
        return None
    by_flag = [len(v.token_ids) >= max_tokens[i] for i, v in cut]
    if all(by_flag):
        limits = sorted({max_tokens[i] for i, _ in cut})
        why = f"--max-tokens {limits[0] if len(limits) == 1 else 'of its line'}: raise it for longer replies"
    elif not any(by_flag):
        why = f"the {max_model_len}-token context is full" if max_model_len else "the context is full"
    else:
        why = "--max-tokens, or the end of the context"
    many = len(outputs) > 1 or len(outputs[0].outputs) > 1
    if not many:
        return f"the reply was cut at the length limit ({why})"
    names = [f"prompt {i + 1}" + (f" variant {v.index + 1}" if len(outputs[i].outputs) > 1 else "")
             if batch else f"variant {v.index + 1}" for i, v in cut]
    return f"cut at the length limit ({why}): {', '.join(names)}"


def identical_note(output, temperature: float) -> str | None:
    """When every variant of a prompt came out the same, say why rather than let -n look broken."""
    if len(output.outputs) < 2 or len({v.text for v in output.outputs}) > 1:
        return None
    return (f"all {len(output.outputs)} variants are identical: at temperature {temperature:g} the model is "
            f"nearly certain of every token of this reply (a higher --temperature or a more open prompt varies "
            f"it)")


# -- --json ----------------------------------------------------------------------------------------------------
def json_report(engine, model_name, outputs, batch, start, first_token_at, total, thinking=None) -> dict:
    def output(v, i):
        reasoning, text = (None, v.text) if thinking is None else split_reasoning(v.text, thinking[i])
        item = {"text": text, "token_ids": v.token_ids, "finish_reason": v.finish_reason}
        if reasoning is not None:
            item["reasoning"] = reasoning    # as OpenAI-compatible servers' reasoning_content
        if v.logprobs is not None:
            item["logprobs"] = _logprobs_json(engine.tokenizer, v.logprobs)
        if v.score is not None:    # beam search: the hypothesis' score (outputs come best first)
            item["score"] = v.score
        return item

    def result(out, i=0):
        # the ids the model saw, after the template; none known when a server rendered the messages itself
        return {"prompt_token_ids": list(out.prompt_token_ids) or None,
                "outputs": [output(v, i) for v in out.outputs],
                "usage": {"prompt_tokens": out.num_prompt_tokens,
                          "completion_tokens": sum(len(v.token_ids) for v in out.outputs)}}

    completion = sum(len(v.token_ids) for o in outputs for v in o.outputs)
    ttft = (first_token_at - start) if first_token_at else None
    decode_time = total - (ttft or 0)
    pool = engine.pool_stats()
    report = {"model": model_name}
    if batch:
        report["results"] = [result(o, i) for i, o in enumerate(outputs)]
        report["usage"] = {"prompt_tokens": sum(o.num_prompt_tokens for o in outputs), "completion_tokens": completion}
    else:
        report.update(result(outputs[0]))
    report["kv"] = kv_report(pool)
    report["timing"] = {"ttft_s": ttft, "decode_tokens_per_s": (completion - len(outputs)) / decode_time
                        if decode_time > 0 and completion > len(outputs) else None, "total_s": total}
    spec = engine.stats().spec
    if spec is not None:  # speculation was on
        report["spec"] = spec
    if any(o.error for o in outputs):
        report["errors"] = [o.error for o in outputs]
    return report


def _logprobs_json(tokenizer, entries) -> list[dict]:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token_id]), "token_id": token_id, "logprob": logprob}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
