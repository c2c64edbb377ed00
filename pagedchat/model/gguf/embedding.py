"""GGUFEmbedding: a token embedding table kept in the GGUF file's block format.

Why: a lookup reads a handful of rows, so nothing is gained by holding the whole table dense, and it is often
the largest tensor of a small model (Gemma 3 270M: 262,144 x 640, 671 MB in fp32, 138 MB as its Q6_K blocks).
A lookup dequantizes just the rows it reads, bit for bit as the whole table would be; the native CPU step reads
the same blocks (pagedchat/native/step.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedchat.model.gguf.quants import dequantize, row_bytes, type_name


class GGUFEmbedding(nn.Module):
    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        expected = row_bytes(qtype, embedding_dim)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise ValueError(f"expected uint8 [vocab, {expected}] {type_name(qtype)} rows of {embedding_dim} values, "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        self.register_buffer("blocks", blocks)
        self.qtype, self.embedding_dim, self.dtype = int(qtype), embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks[ids.reshape(-1)], self.qtype, dtype=self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={type_name(self.qtype)}"
