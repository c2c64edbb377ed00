"""The one chat module that talks to the engine: it runs a turn through the engine's step driver (with the
Ctrl-C flag that stops it between two steps), keeps the pinned branch heads of the sessions, and reads the
pool's numbers. The rest of chat/ (controller, shell, REPL, one-shot) goes through it.
"""

from __future__ import annotations

import signal
import threading
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedchat.engine import Branch, PoolStats, RequestOutput, SamplingParams
from pagedchat.errors import ContextTooLong, PoolTooSmall, UserError
from pagedchat.settings import cli_words

if TYPE_CHECKING:   # only an annotation here: `run` uses stop_on_ctrl_c without loading the engine (pagedchat/quick)
    from pagedchat.engine import Engine


class ContextFull(UserError):
    """The branch no longer fits the model's context. The way out differs between the REPL (slash
    commands, the default advice) and `run --session` (which gives its own)."""

    def __init__(self, what: str, advice: str):
        super().__init__(f"{what}; {advice}")
        self.what = what


@dataclass
class Generated:
    output: RequestOutput
    interrupted: bool          # Ctrl-C (or stop()) ended it early: the outputs are partial, marked abort


class ChatBackend:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop_requested = False     # set by the Ctrl-C handler (stop_on_ctrl_c); read between two steps

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_token_ids(self):
        return self.engine.eos_token_ids

    def describe(self) -> dict | None:
        """The remote side of the numbers (chat/remote_backend.py); None: the local engine generates."""
        return None

    def check_grammar(self, spec) -> None:
        """Raises GrammarError (one line) when the engine cannot enforce this grammar."""
        self.engine.grammars().matcher(spec)

    def stop(self) -> None:
        """Ask the running turn to end after the current step (safe from a signal handler)."""
        self.stop_requested = True

    # -- a turn ---------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], params: SamplingParams, parent: Branch | None, on_update,
                 context: list[list[int]] | None = None, messages: list[dict] | None = None) -> Generated:
        """Run one prompt (n variants, pinned when they finish) to the end or to a stop; on_update(index,
        text so far) as text arrives. A prompt over the context raises ContextFull; a request that failed in
        the engine raises its error (its finished variants released). messages: the same turn as chat
        messages, for a remote server that takes no token ids (unused here)."""
        try:
            rid = self.engine.add_request(prompt, params, keep=True, parent=parent, context=context)
        except ContextTooLong as e:
            raise ContextFull(f"the context is full: this turn needs {e.prompt_tokens} tokens and the model takes "
                              f"{e.max_model_len}", "/clear or /new to start over, /switch to an earlier node") from None
        except PoolTooSmall as e:
            raise UserError(cli_words(e)) from None
        texts: dict[int, str] = {}
        interrupted = False
        self.stop_requested = False
        try:
            with closing(self.engine.steps([rid])) as steps:   # closing early aborts it: its blocks free at once
                for events in steps:
                    for event in events:
                        if event.text:
                            texts[event.index] = texts.get(event.index, "") + event.text
                            if on_update is not None:
                                on_update(event.index, texts[event.index])
                    if self.stop_requested:
                        interrupted = True
                        break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self.stop_requested = False
        out = self.engine.pop_output(rid)
        if out.error and not interrupted:
            for variant in out.outputs:  # a variant that did finish is pinned: nothing will ever reach it
                self.engine.release(variant.handle)
            raise UserError(out.error)
        return Generated(out, interrupted)

    # -- branch pins ----------------------------------------------------------------------------------------
    def pin_for(self, handles: dict[int, Branch], prompt: list[int]) -> Branch | None:
        """The pinned branch head sharing the longest prefix with this prompt (None if none shares any).
        Heads whose pin the engine dropped under memory pressure are forgotten here."""
        best, best_len = None, 0
        for node_id, handle in list(handles.items()):
            if not handle.is_pinned:
                del handles[node_id]
                continue
            k = _common_prefix(prompt, handle.token_ids)
            if k > best_len:
                best, best_len = handle, k
        return best

    def release(self, handle: Branch | None) -> None:
        self.engine.release(handle)

    def persist(self, handles) -> None:
        """Write these branch heads' full blocks through to the disk KV tier (a session save)."""
        self.engine.persist(handles)

    def close(self) -> None:
        """Before exit: the pool's and RAM tier's blocks go to the disk tier for the next process."""
        self.engine.close()

    def blocks_held(self, handles) -> int:
        return self.engine.blocks_held(handles)

    # -- numbers --------------------------------------------------------------------------------------------
    def set_speculation(self, method: str) -> None:
        self.engine.set_speculation(method)

    def pool_stats(self) -> PoolStats:
        return self.engine.pool_stats()

    def stats(self):
        return self.engine.stats()


@contextmanager
def stop_on_ctrl_c(backend: ChatBackend):
    """Ctrl-C while a reply streams stops it at the next step (the engine is never cut mid-step). A backend
    that raises_on_ctrl_c (a remote server: a blocked socket read must end at once) gets the plain
    KeyboardInterrupt instead."""
    if threading.current_thread() is not threading.main_thread() or getattr(backend, "raises_on_ctrl_c", False):
        yield
        return

    def stop(signum, frame):
        backend.stop()

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _common_prefix(a: list[int], b: list[int]) -> int:
    k, limit = 0, min(len(a), len(b))
    while k < limit and a[k] == b[k]:
        k += 1
    return k
