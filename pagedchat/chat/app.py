"""Starting a chat from the command line: pick the session, pick its model, build the engine and controller.

Shared by `pagedchat chat` and `pagedchat run --session/-c`. A saved session remembers its model, so
`--session NAME` without -m reopens it with the model it was made with.
"""

from __future__ import annotations

from dataclasses import replace

from pagedchat.chat.controller import ChatController
from pagedchat.chat.session import check_name
from pagedchat.chat.store import SessionStore
from pagedchat.settings import ModelOptions, SamplingOptions, check_overflow, is_remote, load_engine
from pagedchat.errors import UserError


def start(model_opts: ModelOptions, sampling: SamplingOptions, session_name: str | None, continue_last: bool,
          system: str | None, show_progress: bool = True, store: SessionStore | None = None,
          context_overflow: str | None = None, overflow_default: str = "drop-oldest"):
    """Returns (controller, created): the controller's current session is the one asked for."""
    store = store or SessionStore()
    if continue_last and session_name is None:
        session_name = store.most_recent()
        if session_name is None:
            raise UserError(f"no saved session to continue in {store.root}; start one with --session NAME")
    saved = None
    if session_name is not None:
        check_name(session_name)
        if store.exists(session_name):
            saved = store.load(session_name)
            if model_opts.model is None and saved.model:
                model_opts = replace(model_opts, model=saved.model)
    check_overflow(context_overflow, "--context-overflow")   # before the model loads
    engine, entry, backend = _generator(model_opts, show_progress)
    ctl = ChatController(engine, entry, store, sampling, system, context_overflow, overflow_default, backend=backend)
    if saved is not None:
        ctl.check_model(saved)
        ctl.sessions[saved.name] = ctl.current = saved
        return ctl, False
    if session_name is not None:
        ctl.new_session(session_name)
    else:
        ctl.new_session()
    return ctl, True


def _generator(model_opts: ModelOptions, show_progress: bool):
    """(engine, entry, backend) for the controller: backend is a RemoteBackend when a server generates (the
    engine is then None), else None (the controller wraps the engine in a ChatBackend)."""
    if is_remote(model_opts):
        from pagedchat.chat.remote_backend import open_remote

        backend, entry = open_remote(model_opts, show_progress)
        return None, entry, backend
    engine, entry = load_engine(model_opts, show_progress=show_progress)
    return engine, entry, None
