"""The quick path: `pagedchat run` answering one prompt from a GGUF file on the CPU without importing torch.

Why: importing torch alone takes ~2 s on a small machine, longer than llama.cpp takes to load a small model
and answer. Where the native CPU step (decode.c) runs a file whole, nothing else needs torch: the file is read
mapped (model/gguf/reader.py), its tokenizer and template come from its metadata, and decode.c computes each
step from the mapped blocks. `open_engine` returns a QuickEngine for such a run, or None, and the engine loads
as always: another device, dtype, quantization or KV format, speculation, a family or layer format decode.c
does not run, no native library built yet, or PAGEDCHAT_QUICK=0. The front end also keeps the engine for
what the quick engine does not take (quick/engine.py `takes`, and prompts over QUICK_PROMPT_MAX tokens).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedchat.quick.engine import QuickEngine

ENV_SWITCH = "PAGEDCHAT_QUICK"   # 0: always the engine
# A longer prompt goes to the engine: decode.c prefills ~110 tokens/s per thread (its tiles are made for few
# rows), the engine's batched fp32 prefill ~380, which pays for its ~2.5 s start from about this length on.
QUICK_PROMPT_MAX = 320


def open_engine(config) -> QuickEngine | None:
    """A QuickEngine for this EngineConfig, or None where the engine must run it."""
    if os.environ.get(ENV_SWITCH, "").strip() == "0" or not _plain_cpu_run(config):
        return None
    from pagedchat.model.gguf.locate import resolve_gguf

    paths = resolve_gguf(config.model)
    if paths is None:
        return None
    from pagedchat.native import abi, build

    lib = build.load()   # never waits: with no build yet, one starts in the background and the engine runs
    if not abi.matches(lib):
        return None
    return _open(paths, config, lib)


def _plain_cpu_run(config) -> bool:
    """fp32 on the CPU, the file's own weight formats, an fp32 pool of its own, no speculation."""
    on_cpu = config.device == "cpu" or (config.device == "auto" and not _gpu_present())
    return on_cpu and config.dtype in ("auto", "float32") and config.quantize is None \
        and config.kv_dtype == "auto" and config.speculate == "off" and config.kv_allocation == "paged" \
        and config.num_blocks is None


def _gpu_present() -> bool:
    """Whether `--device auto` could mean a GPU (torch would say; this must not import it): an NVIDIA or AMD
    device node, unless CUDA_VISIBLE_DEVICES hides every GPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))


def _open(paths: list[Path], config, lib):
    from pagedchat.engine.core.config import CPU_DEFAULT_KV_BYTES
    from pagedchat.memory import available_ram
    from pagedchat.model.gguf.reader import open_gguf
    from pagedchat.model.gguf.tokenizer import load_gguf_tokenizer, stop_token_ids
    from pagedchat.quick.engine import QuickEngine
    from pagedchat.quick.model import ARCHITECTURES, NotCovered, bind

    gguf = open_gguf(paths)
    if gguf.architecture not in ARCHITECTURES:
        return None     # the engine runs it, or says why not
    budget = config.kv_memory or (int(available_ram() * config.kv_fraction) if config.kv_fraction
                                  else CPU_DEFAULT_KV_BYTES)
    try:
        model = bind(gguf, config.block_size, budget, config.max_model_len)
    except NotCovered:
        return None
    tokenizer = load_gguf_tokenizer(gguf.metadata, str(paths[0]), light=True)
    if config.chat_template:
        tokenizer.chat_template = config.chat_template
    return QuickEngine(model, lib, tokenizer, stop_token_ids(gguf.metadata, tokenizer), str(paths[0]))

