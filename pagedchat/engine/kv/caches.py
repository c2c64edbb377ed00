"""The pool's tensors: K and V of every layer slot, in the model's dtype or quantized (`--kv-dtype int8|fp8`).

A quantized pool keeps int8 / float8 e4m3 values plus a float16 scale per (slot, KV head) beside them
(pagedchat/kernels/kv_quant.py); every read, write and copy takes the scales with the values. A block's bytes
follow from the tensors, so `--kv-memory` keeps meaning bytes and a quantized pool holds more blocks.

A block leaves the pool (the RAM and disk tiers) as its raw bytes: every tensor's slice of the block, in the
order k values, v values, k scales, v scales, layer by layer. The tiers never interpret them; the disk
fingerprint names the KV dtype, so one dtype's bytes are never read as another's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedchat import kernels
from pagedchat.kernels.kv_quant import KV_DTYPES, SCALE_DTYPE


def kv_cache_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a pool's values are stored in: the model's for "auto"."""
    return model_dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype]


def kv_dtype_name(kv_dtype: str, model_dtype: torch.dtype | None) -> str:
    """What the pool stores, as stats and the disk fingerprint name it: the model's dtype for "auto"
    (float32, bfloat16, ...; "" without a model), else int8 / fp8."""
    if kv_dtype != "auto":
        return kv_dtype
    return "" if model_dtype is None else str(model_dtype).removeprefix("torch.")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer, scales included for a quantized dtype."""
    value = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if dtype in KV_DTYPES.values() else 0
    return 2 * num_layers * num_kv_heads * (head_dim * value + scale)


@dataclass
class KVCaches:
    """One K and one V tensor [num_blocks, block_size, Hkv, D] per layer slot; for a quantized dtype also
    k_scales / v_scales [num_blocks, block_size, Hkv] float16 (None for a float pool)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None

    @classmethod
    def allocate(cls, num_slots: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCaches":
        # Not zero-filled: no path reads a slot before it is written, or it masks what it reads (past a
        # sequence's end, whatever the memory holds, NaN included: tests poison the pool to prove it). On CPU
        # the untouched pages of a large pool then cost nothing at all.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def tensors(shape, dtype):
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_slots)]

        if dtype not in KV_DTYPES.values():
            return cls(tensors(shape, dtype), tensors(shape, dtype))
        return cls(tensors(shape, dtype), tensors(shape, dtype), tensors(shape[:3], SCALE_DTYPE),
                   tensors(shape[:3], SCALE_DTYPE))

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.k_caches[0].dtype

    def layer(self, slot: int) -> dict:
        """What one attention layer reads and writes: its caches and, when quantized, their scales."""
        scales = (self.k_scales[slot], self.v_scales[slot]) if self.quantized else (None, None)
        return {"k_cache": self.k_caches[slot], "v_cache": self.v_caches[slot],
                "k_scale": scales[0], "v_scale": scales[1]}

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool, in a block's byte order."""
        return [*self.k_caches, *self.v_caches, *(self.k_scales or []), *(self.v_scales or [])]

    # -- blocks in and out (the RAM and disk tiers) ------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A CPU copy of these blocks' bytes, uint8 [n, block_bytes]."""
        index = torch.tensor(blocks, device=self.k_caches[0].device)
        parts = [t.view(torch.uint8).index_select(0, index).flatten(1) for t in self._tensors()]
        return torch.cat(parts, dim=1).cpu()

    def write_blocks(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        """Copy each block's bytes straight into its slots: stacking them first would allocate and copy the
        whole load once more (a 4k-token history of a small model is 64 MiB)."""
        tensors = self._tensors()
        for block, payload in zip(blocks, payloads):
            payload = payload.to(self.k_caches[0].device, non_blocking=True)
            offset = 0
            for t in tensors:
                target = t.view(torch.uint8)[block]
                target.copy_(payload[offset:offset + target.numel()].view(target.shape))
                offset += target.numel()
            assert offset == payload.numel(), "a block payload of another layout"

    def copy_blocks(self, src: list[int], dst: list[int], backend: str | None = None) -> None:
        """Copy-on-write: whole blocks src[i] -> dst[i] in every layer, scales with the values."""
        kernels.copy_blocks_all_layers(self.k_caches, self.v_caches, src, dst, backend=backend,
                                       k_scales=self.k_scales, v_scales=self.v_scales)
