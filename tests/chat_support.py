"""Shared set-up for the chat tests: an engine on the tiny ChatML model (conftest `model`), a controller with a
temp store."""

from __future__ import annotations

import io
from pathlib import Path



def make_engine(model: Path, kv_memory: str = "4MiB", block_size: int = 16, max_model_len: int | None = None):
    from pagedchat.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(model), device="cpu", kv_memory=kv_memory, block_size=block_size,
                               max_model_len=max_model_len), show_progress=False)


def make_controller(engine, model: Path, store_dir: Path, system: str | None = None, **sampling):
    """A controller on `engine` with greedy, short replies unless told otherwise."""
    from pagedchat.chat.controller import ChatController
    from pagedchat.chat.store import SessionStore
    from pagedchat.commands.common import SamplingOptions
    from pagedchat.registry import Registry

    options = {"temperature": 0.0, "max_tokens": 8, **sampling}
    entry = Registry().resolve(str(model))
    return ChatController(engine, entry, SessionStore(store_dir), SamplingOptions(**options), system)


def text_console(width: int = 120):
    """A rich console writing plain text into a StringIO: what a user would read, without colours."""
    from rich.console import Console

    buffer = io.StringIO()
    return Console(file=buffer, width=width, force_terminal=False, color_system=None, highlight=False), buffer
