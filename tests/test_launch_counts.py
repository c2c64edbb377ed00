"""Kernel launches of one decode step on the CUDA code path (bench/launches.py), counted on CPU: the fused layer
kernels must keep a decoder layer under a bound, and under the unfused ops' count."""

import pytest

from pagedchat import kernels as K

FUSED_LAYER_BOUND = 10  # 4 matmuls, 2 norms (residual adds inside), rotary + KV write, attention + merge, SiLU x up

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])   # qwen3: its q/k norms ride in the rotary kernel
def test_fused_decode_step_launches_per_layer(model_dirs, arch):
    from pagedchat.bench.launches import count_decode_step

    path = model_dirs[arch][0]
    fused = count_decode_step(path, fused=True, context=40)
    unfused = count_decode_step(path, fused=False, context=40)
    assert fused["per_layer"] <= FUSED_LAYER_BOUND, fused["per_layer_ops"]
    assert fused["per_layer"] < unfused["per_layer"] and fused["per_step"] < unfused["per_step"]
    assert not any(op in fused["per_layer_ops"] for op in ("to", "mul", "add", "roll", "rms_norm")), \
        f"an unfused op or a dtype round trip in a fused layer: {fused['per_layer_ops']}"
    assert fused["per_layer_ops"]["triton:rope_write_kv_kernel"] == 1
