"""A CPU stand-in for CUDA graph capture, so the decode-graph machinery (static buffers, the row-count ladder,
padding rows, the fixed table width and split counts, verify steps as rows) runs in CI against transformers.

`ReplayOnCPU` takes the place of the runner's `CudaGraphCapture`: each "graph" keeps the call it captured (the
model on the static buffers of its size) and its output tensor, and a replay re-runs that call into the same
output. What a replay then computes depends only on what the static buffers hold, as on a GPU."""

from __future__ import annotations

from pagedchat.engine.core.runner import DecodeGraphs


class ReplayOnCPU:
    class Graph:
        def __init__(self, call, out):
            self.call, self.out = call, out

        def replay(self) -> None:
            self.out.copy_(self.call())

        def reset(self) -> None:  # DecodeGraphs.close()
            self.call = None

    @classmethod
    def capture(cls, call, pool):
        out = call().clone()
        return cls.Graph(call, out), out, pool

    @staticmethod
    def synchronize() -> None:
        pass


def capture_on_cpu(runner, max_batch: int, max_query: int = 1) -> DecodeGraphs:
    """Decode graphs of up to `max_batch` rows (`max_query` tokens of one sequence: verify steps) on CPU."""
    graphs = DecodeGraphs.capture(runner, max_batch, max_query, capturer=ReplayOnCPU)
    assert graphs is not None, "capture failed"
    runner.graphs = graphs
    return graphs
