"""`pagedchat serve`: an OpenAI-compatible local server on the same engine and KV pool as chat and run."""

from __future__ import annotations

from typing import Optional

import typer

from pagedchat.commands import common


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve the OpenAI API (/v1/chat/completions, /v1/completions) on one shared "
                              "KV pool: concurrent clients share prompts through the prefix cache.")(serve)


def serve(
    model: Optional[str] = common.MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default loopback only; use "
                                                         "0.0.0.0 to accept other machines, with --api-key)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="PAGEDCHAT_API_KEY",
                                          help="Require `Authorization: Bearer KEY` (env PAGEDCHAT_API_KEY)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id shown to clients (default: the -m name)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every request (uvicorn access log)."),
    device: str = common.DEVICE,
    dtype: Optional[str] = common.DTYPE,
    block_size: int = common.BLOCK_SIZE,
    kv_memory: Optional[str] = common.KV_MEMORY,
    max_context: Optional[int] = common.MAX_CONTEXT,
    kv_allocation: str = typer.Option("paged", "--kv-allocation",
                                      help="paged, or reserved: every request takes the blocks of its prompt + "
                                           "max_tokens at admission and shares none, as a contiguous KV cache "
                                           "must (the peer `pagedchat bench serve` measures against)."),
    speculate: Optional[str] = common.SPECULATE,
    num_draft_tokens: Optional[int] = common.NUM_DRAFT_TOKENS,
    draft_model: Optional[str] = common.DRAFT_MODEL,
    kv_disk: Optional[str] = common.KV_DISK,
    kv_ram: Optional[str] = common.KV_RAM,
    context_overflow: Optional[str] = common.CONTEXT_OVERFLOW,
    quantize: Optional[str] = common.QUANTIZE,
    kv_dtype: Optional[str] = common.KV_DTYPE,
    no_web: bool = typer.Option(False, "--no-web", help="Do not serve the chat page at / (the API only)."),
    allowed_host: list[str] = typer.Option([], "--allowed-host",
                                           help="Also answer to this host name (besides the listening address, "
                                                "localhost, 127.0.0.1 and [::1]); repeatable. Other names are "
                                                "refused: DNS rebinding protection."),
    allowed_origin: list[str] = typer.Option([], "--allowed-origin",
                                             help="Also accept state-changing requests from web pages of this "
                                                  "origin (e.g. http://localhost:3000); repeatable."),
) -> None:
    from pagedchat.serve.server import run_server

    common.check_overflow(context_overflow, "--context-overflow")
    opts = common.ModelOptions(model=model, device=device, dtype=dtype, block_size=block_size, kv_memory=kv_memory,
                               max_context=max_context, kv_allocation=kv_allocation,
                               speculate=speculate, num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                               quantize=quantize, kv_disk=kv_disk, kv_ram=kv_ram, kv_dtype=kv_dtype)
    run_server(opts, host, port, api_key, served_model_name, verbose, context_overflow, web=not no_web,
               allowed_hosts=tuple(allowed_host), allowed_origins=tuple(allowed_origin))
