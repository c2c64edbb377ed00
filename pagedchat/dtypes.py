"""The weight/KV dtypes pagedchat accepts, by every name it accepts (one list for the CLI, models.toml,
the engine config, the loader and the benchmarks). No imports: the registry reads it without torch."""

from __future__ import annotations

# accepted name -> the torch attribute it means; "auto" (bf16 on CUDA, fp32 on CPU) is resolved by the loader
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPES)
DTYPE_HINT = "use auto, float32, bfloat16 or float16"

# --kv-dtype: what the KV pool stores. auto = the model's dtype; int8 / fp8 (e4m3) = quantized values with a
# float16 scale per token and KV head (pagedchat/kernels/kv_quant.py). The devices each one runs on:
KV_DTYPE_DEVICES = {"auto": ("cpu", "cuda"), "int8": ("cpu", "cuda"), "fp8": ("cuda",)}
KV_DTYPE_CHOICES = tuple(KV_DTYPE_DEVICES)


def kv_dtype_problem(kv_dtype: str, device_type: str | None = None) -> str | None:
    """Why `kv_dtype` cannot run (on `device_type`, when known), as a "{name} ..." template; None when it can."""
    if kv_dtype not in KV_DTYPE_DEVICES:
        return f"{{name}} must be one of {', '.join(KV_DTYPE_CHOICES)}, got {kv_dtype!r}"
    if device_type is not None and device_type not in KV_DTYPE_DEVICES[kv_dtype]:
        runs_here = [k for k, devices in KV_DTYPE_DEVICES.items() if device_type in devices]
        return (f"{{name}} {kv_dtype} runs on {' and '.join(d.upper() for d in KV_DTYPE_DEVICES[kv_dtype])} "
                f"only; on {device_type.upper()} use {' or '.join(runs_here)}")
    return None
