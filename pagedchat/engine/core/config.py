"""Engine and pool configuration: one dataclass for what the user can set about the engine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pagedchat.dtypes import DTYPE_CHOICES, DTYPE_HINT, kv_dtype_problem
from pagedchat.errors import SettingError, UserError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
FUSED_ENV = "PAGEDCHAT_FUSED"
OVERLAP_ENV = "PAGEDCHAT_OVERLAP"
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str | int | None, allow_zero: bool = False) -> int | None:
    """'512MiB', '4GiB', '256KiB', '1.5G' or a plain byte count -> bytes. None stays None."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"invalid size {text!r}: use bytes or a KiB/MiB/GiB suffix, e.g. 512MiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0 or n == 0 and not allow_zero:
        raise UserError(f"invalid size {text!r}: must be positive")
    return n


def _switch(value: bool | None, env: str, default: bool) -> bool:
    """A config switch: its value if set, else the environment variable's 0|1, else the default."""
    if value is None and os.environ.get(env, "").strip() in ("0", "1"):
        value = os.environ[env].strip() == "1"
    return default if value is None else value


def _parse_percent(text: str) -> float:
    try:
        value = float(text.strip()[:-1]) / 100
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise SettingError("kv_memory", f"invalid {{name}} {text!r}: a percentage must be in (0%, 100%]")
    return value


CPU_DEFAULT_KV_BYTES = 512 * 1024**2   # the KV pool on CPU when neither kv_memory nor kv_fraction is given


@dataclass
class EngineConfig:
    model: str                      # local HF folder (resolved by the registry/loader)
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    dtype: str = "auto"             # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_memory: int | str | None = None  # bytes, '512MiB', or '40%' of free memory; None = kv_fraction
    kv_fraction: float | None = None  # of free memory (CUDA: after weights and a profiled forward);
                                      # None = 0.9 on CUDA; on CPU 512MiB, capped at max_num_seqs
                                      # full contexts
    num_blocks: int | None = None   # exact pool size in blocks (tests, benchmarks); overrides kv_memory
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 256         # running sequences per step
    max_num_batched_tokens: int = 2048  # per-step token budget; prefill is chunked to fit it
    enable_prefix_cache: bool = True
    kv_allocation: str = "paged"    # paged | reserved: the peer a contiguous cache stands for (bench serve)
    cuda_graphs: bool = True        # capture decode batches on CUDA
    fused_kernels: bool | None = None  # the fused layer kernels (norm+add, rotary+KV write, SiLU x up);
                                       # None = $PAGEDCHAT_FUSED (0|1) if set, else on for CUDA only
    overlap: bool | None = None     # schedule and launch step N+1 before step N's tokens reach the host;
                                    # None = $PAGEDCHAT_OVERLAP (0|1) if set, else on for CUDA only
    trust_remote_code: bool = False
    chat_template: str | None = None  # replaces the folder's template (models.toml chat_template), set at load
    speculate: str = "off"          # off | ngram | draft (speculative decoding, see engine/decoding/speculative.py)
    num_draft_tokens: int = 6       # most tokens proposed per sequence and step (adapted per sequence)
    draft_model: str | None = None  # a smaller model with the same tokenizer (speculate="draft")
    quantize: str | None = None     # None | "none" | "int8" | "int4": weight-only, from the fp checkpoint (model/quantize.py);
                                    # on a GGUF None keeps the file's block formats and "none" dequantizes
    kv_dtype: str = "auto"          # auto (the model's dtype) | int8 (CPU, CUDA) | fp8 (CUDA): what the pool
                                    # stores; quantized: + a float16 scale per token and KV head
    # Tiers below the pool (0 = off; the library default, so tests and benchmarks keep no state; the CLI
    # turns both on): evicted blocks go to host RAM, then to disk, where other processes find them too.
    kv_ram: int | str = 0           # bytes or '512MiB'
    kv_disk: int | str = 0          # bytes or '2GiB'; blocks live in kv_dir/<model fingerprint>/
    kv_dir: str | None = None       # None = $XDG_CACHE_HOME/pagedchat/kv

    def __post_init__(self):
        if isinstance(self.kv_memory, str) and self.kv_memory.strip().endswith("%"):
            self.kv_fraction = _parse_percent(self.kv_memory)
            self.kv_memory = None
        self.kv_memory = parse_size(self.kv_memory)
        self.kv_ram = parse_size(self.kv_ram, allow_zero=True)
        self.kv_disk = parse_size(self.kv_disk, allow_zero=True)
        if not 8 <= self.block_size <= 128 or self.block_size & (self.block_size - 1):
            raise SettingError("block_size", f"{{name}} must be a power of two from 8 to 128, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise SettingError("max_model_len", f"{{name}} must be a positive number of tokens, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise UserError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.kv_fraction is not None and not 0 < self.kv_fraction <= 1:
            raise UserError(f"kv fraction must be in (0, 1], got {self.kv_fraction}")
        if self.kv_allocation not in ("paged", "reserved"):
            raise SettingError("kv_allocation", f"{{name}} must be paged or reserved, got {self.kv_allocation!r}")
        if self.kv_allocation == "reserved":
            # A contiguous per-request region cannot hold another request's blocks: no prefix sharing.
            self.enable_prefix_cache = False
        # "none" stays as said: on a GGUF file it means dequantize (the default keeps the file's formats)
        if self.quantize not in (None, "none", "int8", "int4"):
            raise SettingError("quantize", f"{{name}} must be int8, int4 or none, got {self.quantize!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise UserError(f"unknown dtype {self.dtype!r}: {DTYPE_HINT}")
        self.check_kv_dtype("cpu" if self.device == "cpu" else None)
        self._check_speculation()

    def fused_backend(self, device_type: str) -> str | None:
        """The kernels backend of the fused layer kernels on this device ("auto": Triton on CUDA), or None
        for the unfused ops (the CPU default: the torch ops and the native step are faster there)."""
        return "auto" if _switch(self.fused_kernels, FUSED_ENV, device_type == "cuda") else None

    def overlaps(self, device_type: str) -> bool:
        """Whether steps overlap (Engine.step): on a GPU the host's work for the next step then runs while the
        device computes this one; on a CPU the host is the device, so there is nothing to overlap (tests turn
        it on there to check it)."""
        return _switch(self.overlap, OVERLAP_ENV, device_type == "cuda")

    def check_kv_dtype(self, device_type: str | None) -> None:
        """Refuse a KV dtype the device cannot run (device_type None: not known yet, the name alone)."""
        problem = kv_dtype_problem(self.kv_dtype, device_type)
        if problem:
            raise SettingError("kv_dtype", problem)

    def _check_speculation(self) -> None:
        if self.draft_model and self.speculate == "off":
            self.speculate = "draft"  # --draft-model alone asks for it
        if self.speculate not in ("off", "ngram", "draft"):
            raise SettingError("speculate", f"{{name}} must be ngram, draft or off, got {self.speculate!r}")
        if self.speculate == "draft" and not self.draft_model:
            raise SettingError("speculate", "{name} draft needs a draft model (--draft-model NAME|PATH)")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 32:
            raise SettingError("num_draft_tokens", f"{{name}} must be from 1 to 32, got {self.num_draft_tokens}")
