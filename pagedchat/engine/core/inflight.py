"""A step whose sampled tokens are still on their way to the host (overlapped steps, Engine.step).

The tokens stay on the device, where the next step reads them as its input ids; one copy to pinned host
memory is queued behind them, and the host waits for it only after it has launched that next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedchat.engine.core.sequence import Sequence


@dataclass
class InFlight:
    seqs: list[Sequence]             # row i of `tokens` is seqs[i]'s next token
    tokens: torch.Tensor             # [rows] int64, on the device
    host: torch.Tensor               # their copy on the host (being made, on a GPU)
    copied: torch.cuda.Event | None  # recorded after the copy (None: on the CPU the copy is the tensor)

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> "InFlight":
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tokens.device))   # the copy's stream (cuda:N included)
        return cls(seqs, tokens, host, copied)

    def wait(self) -> list[int]:
        """The tokens on the host, once the step that samples them is done (waits for that step only)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
