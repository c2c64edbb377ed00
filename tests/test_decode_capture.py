"""Every family's decode step can be captured in a CUDA graph, shown on CPU.

A captured graph cannot read a value back to the host, make a tensor from host data or size an output from
the data. The decode forward of every family runs here on the CUDA code path (every attention and MoE layer
on the Triton kernels, under the interpreter) inside a guard that flags any such op (tests/host_sync.py).
The replay side of the graphs (static buffers, padded batch sizes, the window groups' own tables) runs too,
with an eager stand-in for the graph. The real capture of every family is a `gpu` test
(test_gpu_engine.py)."""

import pytest
import torch

from graph_double import capture_on_cpu
from hf_models import ARCHS, NEW_FAMILIES
from host_sync import HostSyncError, no_host_sync, recording_host_syncs
from oracle import assert_greedy_equal, reference
from pagedchat import kernels as K
from pagedchat.engine import Engine, EngineConfig, SamplingParams

FAMILIES = ARCHS + NEW_FAMILIES
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]


def _bool_index(x):
    return x[x > 0]


@pytest.mark.parametrize("op", [
    lambda x: torch.bincount(x.long().abs(), minlength=4),   # what the MoE routing used to count experts with
    lambda x: x * torch.tensor(8.0, dtype=x.dtype),          # what Gemma's embedding scale used to be
    lambda x: x.sum().item(),
    lambda x: x.tolist(),
    lambda x: int(x[0]),
    _bool_index,
    lambda x: torch.nonzero(x),
])
def test_the_guard_flags_what_a_graph_cannot_capture(op):
    with pytest.raises(HostSyncError):
        with no_host_sync():
            op(torch.arange(-3, 5))


def test_the_guard_lets_device_side_code_through():
    x = torch.arange(-3, 5)
    with recording_host_syncs() as found:
        counts = torch.zeros(4, dtype=torch.long).scatter_add_(0, x.abs() % 4, torch.ones_like(x))
        torch.searchsorted(torch.cumsum(counts, 0), torch.arange(4), right=True)
        torch.topk(x.float().softmax(0), 2)
        x * 8.0
    assert found == []


def _on_triton(engine) -> None:
    model = engine.runner.model
    for layer in model.attention_layers() + (model.moe_layers() if hasattr(model, "moe_layers") else []):
        layer.backend = "triton"


@pytest.mark.parametrize("arch", FAMILIES)
def test_decode_forward_of_every_family_never_syncs_with_the_host(model_dirs, monkeypatch, arch):
    if not K.HAS_TRITON:
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = Engine(EngineConfig(model=str(model_dirs[arch][0]), num_blocks=64, block_size=8), show_progress=False)
    _on_triton(engine)
    model, guarded = engine.runner.model, []

    def guard_decode(module, args):
        if args[2].is_decode:
            guarded.append(no_host_sync(f"{arch}'s decode forward"))
            guarded[-1].__enter__()

    def leave(module, args, out):
        if args[2].is_decode:
            guarded[-1].__exit__(None, None, None)

    model.register_forward_pre_hook(guard_decode)
    model.register_forward_hook(leave)
    engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(guarded) == 2   # two decode steps, both inside the guard (the prefill samples the first token)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma3"])
def test_replay_through_static_buffers_matches_transformers(model_dirs, arch):
    """Three sequences padded to a graph of 4 rows, over the static tables of the full context (and Gemma's
    window groups through their own): the tokens of an eager run."""
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), num_blocks=128, block_size=8), show_progress=False)
    runner = engine.runner
    runner.native, runner._native_next_try = None, None   # the torch forward, as the graph would run it
    capture_on_cpu(runner, 4)  # graphs of 1, 2 and 4 rows, replayed on CPU
    batch = PROMPTS + [list(range(60, 100))]
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=40))
    for prompt, out in zip(batch, outs):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 40))
