"""`pagedchat chat`: the interactive REPL (streaming replies, conversation trees, variants, sessions)."""

from __future__ import annotations

from typing import Optional

import typer

from pagedchat.commands import common


def register(app: typer.Typer) -> None:
    app.command("chat", help="Chat interactively: branch, regenerate, edit, fork N variants; sessions autosave. "
                             "Type /help inside.")(chat)


def chat(
    model: Optional[str] = common.MODEL,
    session: Optional[str] = typer.Option(None, "--session", "-s",
                                          help="Open session NAME (created if new); default: a new session."),
    continue_last: bool = typer.Option(False, "-c", "--continue", help="Reopen the most recently used session."),
    system: Optional[str] = common.SYSTEM,
    temperature: Optional[float] = common.TEMPERATURE,
    top_p: Optional[float] = common.TOP_P,
    top_k: Optional[int] = common.TOP_K,
    min_p: Optional[float] = common.MIN_P,
    repetition_penalty: Optional[float] = common.REPETITION_PENALTY,
    max_tokens: Optional[int] = common.MAX_TOKENS,
    seed: Optional[int] = common.SEED,
    stop: Optional[list[str]] = common.STOP,
    device: str = common.DEVICE,
    dtype: Optional[str] = common.DTYPE,
    block_size: int = common.BLOCK_SIZE,
    kv_memory: Optional[str] = common.KV_MEMORY,
    max_context: Optional[int] = common.MAX_CONTEXT,
    context_overflow: Optional[str] = common.CONTEXT_OVERFLOW,
    speculate: Optional[str] = common.SPECULATE,
    num_draft_tokens: Optional[int] = common.NUM_DRAFT_TOKENS,
    draft_model: Optional[str] = common.DRAFT_MODEL,
    kv_disk: Optional[str] = common.KV_DISK,
    kv_ram: Optional[str] = common.KV_RAM,
    quantize: Optional[str] = common.QUANTIZE,
    server: Optional[str] = common.SERVER,
) -> None:
    model_opts = common.ModelOptions(model=model, device=device, dtype=dtype, block_size=block_size,
                                    kv_memory=kv_memory, max_context=max_context, speculate=speculate,
                                    num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                                    server=server, quantize=quantize, kv_disk=kv_disk, kv_ram=kv_ram)
    sampling = common.SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      max_tokens=max_tokens, seed=seed, repetition_penalty=repetition_penalty,
                                      stop=stop)
    # bad flags fail before torch loads
    common.check_before_load(model_opts, sampling, model_from_session=model is None and (session or continue_last))
    common.check_overflow(context_overflow, "--context-overflow")
    from rich.console import Console
    from rich.text import Text

    from pagedchat.chat.app import start
    from pagedchat.chat.repl import run_repl

    ctl, created = start(model_opts, sampling, session, continue_last, system, context_overflow=context_overflow)
    console = Console(highlight=False)
    if system is not None and not created and (ctl.session.system or None) != (system or None):
        console.print(Text(ctl.set_system(system), style="yellow"))
    try:
        code = run_repl(ctl, console)
    finally:
        ctl.backend.close()  # what the pool and RAM tier hold goes to the disk tier for the next process
    raise typer.Exit(code)

