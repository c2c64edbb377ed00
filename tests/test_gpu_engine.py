"""End to end on CUDA (skipped without a GPU): Triton kernels + CUDA graphs against transformers."""

import pytest
import torch

from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from test_engine_equality import prompts
from pagedchat.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_fp32_greedy_matches_transformers(model_dirs, arch, graphs):
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=512,
                                 cuda_graphs=graphs, max_num_seqs=32), show_progress=False)
    assert (engine.runner.graphs is not None) == graphs
    batch = prompts(12, seed=21, lo=3, hi=90)
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(batch, outs):
        ref_tokens, ref_logits = reference(hf, prompt, 20)
        assert_greedy_equal(out.outputs[0].token_ids, ref_tokens, ref_logits)
    engine.check_invariants()


def test_cuda_bf16_default_runs_and_pool_is_sized_from_free_memory(model_dirs):
    path, _ = model_dirs["qwen3"]
    engine = Engine(EngineConfig(model=str(path), device="cuda", kv_fraction=0.2), show_progress=False)
    assert engine.loaded.dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert engine.pool.num_blocks * engine.runner.bytes_per_block <= 0.2 * total
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
