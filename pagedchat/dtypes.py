"""The weight/KV dtypes pagedchat accepts, by every name it accepts (one list for the CLI, models.toml,
the engine config, the loader and the benchmarks). No imports: the registry reads it without torch."""

from __future__ import annotations

# accepted name -> the torch attribute it means; "auto" (bf16 on CUDA, fp32 on CPU) is resolved by the loader
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPES)
DTYPE_HINT = "use auto, float32, bfloat16 or float16"
