"""The typer options `run`, `chat` and `serve` share; what they configure lives in pagedchat.settings."""

from __future__ import annotations

import typer

from pagedchat.prompts import chat_prompt_ids, render_chat  # noqa: F401  (re-exported for the commands)
from pagedchat.settings import (  # noqa: F401  (re-exported for the commands)
    ModelOptions,
    SamplingOptions,
    check_before_load,
    check_overflow,
    cli_words,
    is_remote,
    load_engine,
    engine_config,
    resolve_entry,
    resolve_sampling,
)

# -- options (typer.Option objects are reused across commands) -----------------------------------------------
MODEL = typer.Option(None, "-m", "--model", help="models.toml name or alias, local HF folder, or HF repo id.")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda or auto.")
DTYPE = typer.Option(None, "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.")
BLOCK_SIZE = typer.Option(16, "--block-size", help="Tokens per KV block (8..128, power of two).")
KV_MEMORY = typer.Option(None, "--kv-memory", help="KV pool size: bytes, 256KiB/512MiB/4GiB, or 40% of free memory "
                                                   "(default: 90% of free GPU memory, 512MiB on CPU).")
KV_DISK = typer.Option(None, "--kv-disk", help="Disk tier for KV blocks under $XDG_CACHE_HOME/pagedchat/kv, shared "
                                               "across processes (default 2GiB; 0 = off).")
KV_RAM = typer.Option(None, "--kv-ram", help="Host-RAM tier for KV blocks the pool evicts (default 512MiB; 0 = off).")
QUANTIZE = typer.Option(None, "--quantize", help="Weight-only, quantized at load from the fp checkpoint: int8 "
                                                 "(per-channel scales) or int4 (groups of 32, a scale each); "
                                                 "none: off (default: the models.toml quantize key, else none).")
KV_DTYPE = typer.Option(None, "--kv-dtype", help="What the KV pool stores: auto (the model's dtype), int8 (CPU, "
                                               "CUDA) or fp8 (CUDA): quantized with a scale per token and head, "
                                               "~2x (bf16->fp8) to ~3.9x (fp32->int8) the tokens in the same "
                                               "--kv-memory (default: the models.toml kv_dtype key, else auto).")
MAX_CONTEXT = typer.Option(None, "--max-context", help="Cap the context length (tokens).")
SYSTEM = typer.Option(None, "--system", help="System prompt (chat template path).")
TEMPERATURE = typer.Option(None, "--temperature", "-t", help="0 = greedy.")
TOP_P = typer.Option(None, "--top-p")
TOP_K = typer.Option(None, "--top-k", help="0 = off.")
MIN_P = typer.Option(None, "--min-p")
REPETITION_PENALTY = typer.Option(None, "--repetition-penalty")
MAX_TOKENS = typer.Option(None, "--max-tokens", help="Most tokens to generate per reply.")
SEED = typer.Option(None, "--seed", help="Per-request seed: same seed, same tokens, whatever else runs.")
STOP = typer.Option(None, "--stop", metavar="<str>", help="Stop string (repeatable: --stop A --stop B).")
CONTEXT_OVERFLOW = typer.Option(None, "--context-overflow",
                                help="When a conversation outgrows the context: stop (refuse the turn) or "
                                     "drop-oldest (keep the system prompt and the newest turns that fit). "
                                     "Default: drop-oldest in chat, stop in run and serve.")
SPECULATE = typer.Option(None, "--speculate", help="Speculative decoding: ngram (drafts copied from the prompt, "
                                                   "history and sibling replies), draft (--draft-model) or off.")
NUM_DRAFT_TOKENS = typer.Option(None, "--num-draft-tokens", help="Most draft tokens per step (adapted per "
                                                                 "sequence to its acceptance; default 6).")
SERVER = typer.Option(None, "--server", metavar="URL",
                      help="An OpenAI-compatible server (pagedchat serve, vLLM, SGLang, llama.cpp) generates; -m "
                           "names the local model whose tokenizer and template render the prompt.")
DRAFT_MODEL = typer.Option(None, "--draft-model", help="Smaller model with the same tokenizer that proposes "
                                                       "drafts (models.toml name or folder). Its KV shares the "
                                                       "pool: each block also holds the draft's KV of its tokens.")
