"""The Triton attention entry points: v2 (page-tiled, default) or v1 (the first kernels), chosen per call.

`impl` picks one ("v1" or "v2"); without it the PAGEDCHAT_ATTN environment variable does (read at every call,
so one process, one GPU run, measures both side by side); without that, v2.
"""

from __future__ import annotations

import os

from .kv_quant import is_quantized
from .triton_attention_v1 import paged_decode_attention_v1, paged_prefill_attention_v1
from .triton_attention_v2 import paged_decode_attention_v2, paged_prefill_attention_v2

ATTN_ENV = "PAGEDCHAT_ATTN"
IMPLS = ("v1", "v2")
DEFAULT_IMPL = "v2"


def attention_impl(impl: str | None = None) -> str:
    """The implementation a call runs: `impl`, else $PAGEDCHAT_ATTN, else the default."""
    chosen = impl or os.environ.get(ATTN_ENV) or DEFAULT_IMPL
    if chosen not in IMPLS:
        raise ValueError(f"attention implementation must be one of {IMPLS} ({ATTN_ENV}), got {chosen!r}")
    return chosen


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, *, impl=None,
                                  **options):
    """Triton decode attention (see pagedchat.kernels.paged_decode_attention). Options of v1: num_splits;
    of v2: config, num_sms, k_scale, v_scale; of both: sliding_window, softcap."""
    run = paged_decode_attention_v2 if attention_impl(impl) == "v2" else _unquantized(paged_decode_attention_v1)
    return run(q, k_cache, v_cache, block_tables, seq_lens, scale, out, **options)


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None, *,
                                   impl=None, **options):
    """Triton chunked causal prefill (see pagedchat.kernels.paged_prefill_attention). Options of v2: config,
    k_scale, v_scale."""
    run = paged_prefill_attention_v2 if attention_impl(impl) == "v2" else _unquantized(paged_prefill_attention_v1)
    return run(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, **options)


def _unquantized(v1_function):
    """v1 with a quantized pool's calls refused in one clear line (only v2 reads quantized pools)."""
    def run(*args, k_scale=None, v_scale=None, **options):
        if k_scale is not None or is_quantized(args[1]):
            raise ValueError(f"the v1 attention kernels read float KV pools only; {ATTN_ENV}=v2 (the default) "
                             "reads int8 / fp8 pools")
        return v1_function(*args, **options)
    return run
