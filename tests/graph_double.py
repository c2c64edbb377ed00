"""A CPU stand-in for CUDA graph capture, so the decode-graph machinery (static buffers, the batch-size ladder,
padding rows, the fixed table width and split counts) runs in CI against transformers.

`CapturedGraphs` is the runner's `DecodeGraphs` with capture replaced: each "graph" keeps the call it captured
(the model on the static buffers of its size) and its output tensor, and a replay re-runs that call into the same
output. What a replay then computes depends only on what the static buffers hold, as on a GPU."""

from __future__ import annotations

from pagedchat.engine.core.runner import DecodeGraphs


class _Replay:
    def __init__(self, call, out):
        self.call, self.out = call, out

    def replay(self) -> None:
        self.out.copy_(self.call())


class CapturedGraphs(DecodeGraphs):
    def _capture_all(self) -> None:
        model = self.runner.model
        for size in reversed(self.sizes):
            meta = self._meta(size)

            # Fresh views of the static buffers on every replay: the model caches per-step tables by the identity
            # of its positions tensor (RotaryEmbedding.tables), which a real graph replay never consults.
            def call(size=size, meta=meta):
                return model(self.ids[:size], self.positions[:size], meta)

            out = call().clone()
            self.graphs[size] = (_Replay(call, out), out)


def capture_on_cpu(runner, max_batch: int) -> CapturedGraphs:
    graphs = CapturedGraphs.capture(runner, max_batch)
    assert graphs is not None, "capture failed"
    runner.graphs = graphs
    return graphs
