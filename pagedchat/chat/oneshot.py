"""`pagedchat run --session NAME` / `run -c`: one turn of a saved session from the shell.

The reply streams to stdout (or one JSON object with --json), the exchange is saved in the session, and
the exit code says what happened: 0 done, 1 the reply failed or could not be saved, 2 a usage error
(raised as UserError), 130 interrupted (the partial reply is saved, marked interrupted).
"""

from __future__ import annotations

import json
import sys

from pagedchat.chat.app import start
from pagedchat.chat.backend import ContextFull, stop_on_ctrl_c
from pagedchat.settings import ModelOptions, SamplingOptions, kv_report
from pagedchat.errors import UserError
from pagedchat.prompts import require_text
from pagedchat.words import cut_mark, for_stdout


def run_in_session(model_opts: ModelOptions, sampling: SamplingOptions, text: str, session: str | None,
                   continue_last: bool, system: str | None, num_variants: int, as_json: bool,
                   context_overflow: str | None = None) -> int:
    require_text(text)
    ctl, created = start(model_opts, sampling, session, continue_last, system, show_progress=not as_json,
                         context_overflow=context_overflow, overflow_default="stop")
    try:
        return _run_turn(ctl, created, text, system, num_variants, as_json)
    finally:
        ctl.backend.close()  # the session's blocks reach the disk tier: the next `run --session` loads them


def _run_turn(ctl, created: bool, text: str, system: str | None, num_variants: int, as_json: bool) -> int:
    current = ctl.session
    if system is not None and not created and (current.system or None) != (system or None) \
            and current.num_messages:
        raise UserError(f"session {current.name} has a different system prompt; --system only applies to new "
                        f"sessions (use /system in `pagedchat chat --session {current.name}`)")
    if system is not None and not current.num_messages:
        current.system = system or None
    head = current.head_node()
    streaming = not as_json and num_variants == 1
    shown = [0]

    def write(index: int, so_far: str) -> None:
        sys.stdout.write(for_stdout(so_far[shown[0]:]))
        sys.stdout.flush()
        shown[0] = len(so_far)

    if head is not None and head.role == "user":
        raise UserError(f"the head of session {current.name} (#{head.id}) is a message with no reply; answer "
                        f"it in `pagedchat chat --session {current.name}` (/regen)")
    try:
        with stop_on_ctrl_c(ctl.backend):
            result = ctl.send(text, n=num_variants, on_update=write if streaming else None)
    except ContextFull as e:
        raise UserError(f"{e.what}; start a new session (--session NEW), or open this one with "
                        f"`pagedchat chat --session {current.name}` and /switch to an earlier turn") from None
    if as_json:
        print(json.dumps(_report(ctl, result)))
    elif streaming:
        reply = result.replies[0] if result.replies else None
        if reply is not None and len(reply.text) > shown[0]:
            sys.stdout.write(for_stdout(reply.text[shown[0]:]))  # held back while it might have been a stop string
        sys.stdout.write((cut_mark(reply.finish_reason) if reply is not None else "") + "\n")
    else:
        for reply in result.replies:
            print(f"--- variant {reply.variant or 1} (#{reply.id}) ---")
            print(for_stdout(reply.text) + cut_mark(reply.finish_reason))
    sys.stdout.flush()
    for line in result.notes:   # stdout holds the reply alone: what to know about it goes to stderr
        print(f"pagedchat: note: {line}", file=sys.stderr)
    cut = [r for r in result.replies if r.finish_reason == "length"]
    if cut and not as_json and not sys.stdout.isatty() and result.stats.get("capped_max_tokens") is None:
        which = "the reply was" if len(result.replies) == 1 else f"{len(cut)} of {len(result.replies)} variants were"
        print(f"pagedchat: note: {which} cut at the length limit (--max-tokens): raise it for longer replies",
              file=sys.stderr)
    if result.save_error:
        print(f"pagedchat: error: {result.save_error}", file=sys.stderr)
        return 1
    if result.interrupted:
        print(f"pagedchat: interrupted (the partial reply is saved in session {current.name})", file=sys.stderr)
        return 130
    return 0


def _report(ctl, result) -> dict:
    """The DESIGN.md `--json` shape, plus where the exchange went in the session."""
    stats = result.stats
    pool = ctl.backend.pool_stats()
    decode = stats["tokens_per_s"]
    return {
        "model": ctl.entry.name,
        "session": {"name": ctl.session.name, "user_node": result.user.id if result.user else None,
                    "reply_nodes": [r.id for r in result.replies], "head": ctl.session.head},
        "prompt_token_ids": stats.get("prompt_token_ids"),   # the whole path the model saw (None: a server's)
        "outputs": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
                    for r in result.replies],
        "usage": {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
                  "prompt_cached_tokens": stats["prompt_cached"]},
        "kv": kv_report(pool),
        "timing": {"ttft_s": stats["ttft_s"], "decode_tokens_per_s": decode, "total_s": stats["total_s"]},
        **({"spec": spec} if (spec := ctl.backend.stats().spec) is not None else {}),
        # --server: where it ran, the endpoint, whether the history is token-exact, the server's cache
        **({"remote": remote} if (remote := ctl.backend.describe()) is not None else {}),
    }
