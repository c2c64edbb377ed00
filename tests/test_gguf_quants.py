"""GGUF block formats dequantized in torch (pagedchat/model/gguf/quants.py) and by the native library
(pagedchat/native/dequantize.py) against gguf-py's numpy reference, bit for bit, and GGUFLinear against F.linear
with the reference weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
import gguf.quants as reference

from real_files import real_file
from pagedchat.errors import ModelLoadError
from pagedchat.model.gguf import quants
from pagedchat.model.gguf.linear import GGUFLinear
from pagedchat.model.gguf.quants import SUPPORTED, check_supported, dequantize, row_bytes

TYPES = sorted(T(t) for t in SUPPORTED)
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]   # gguf-py can quantize these
SHAPES = [(1, 256), (7, 512), (3, 2304)]
F16_FIELDS = {   # byte offsets of each block's float16 scales
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def _finite_16bit(rng, n: int, exponent_mask: int) -> np.ndarray:
    """n random 16-bit patterns, none of them inf or NaN (all-ones exponent) for the float16/bfloat16 layout
    `exponent_mask` selects: every sign, subnormals and zeros included."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & exponent_mask) == exponent_mask] &= np.uint16(~0x4000 & 0xFFFF)   # clear the exponent's top bit
    return bits


def _random_rows(qtype: T, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bytes with finite float scales, so both sides see no NaN or inf."""
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return (rng.standard_normal((rows, width)) * 10.0 ** rng.integers(-30, 30, (rows, width))).astype(
            np.float32).view(np.uint8)
    if qtype in (T.F16, T.BF16):
        return _finite_16bit(rng, rows * width, 0x7C00 if qtype == T.F16 else 0x7F80).view(np.uint8).reshape(rows, -1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, width // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = _finite_16bit(rng, len(blocks), 0x7C00).view(np.uint8).reshape(-1, 2)
    return raw


def _quantized_rows(qtype: T, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """What gguf-py's own quantizer writes for random weights, as uint8 [rows, row_bytes]."""
    data = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    return reference.quantize(data, qtype).view(np.uint8).reshape(rows, -1)


@pytest.fixture(params=["torch", "native"])
def dequantizer(request, monkeypatch):
    """Which dequantizer quants.dequantize uses: its torch functions, or the native library's (installed by the
    runner once the library is loaded, so a test that only said nothing would depend on what ran before it)."""
    monkeypatch.setattr(quants, "_fast", None)   # (and put back whatever was installed, after the test)
    if request.param == "native":
        from pagedchat.native import build, dequantize as native_dequantize

        lib = build.load(wait=True)
        if lib is None:
            pytest.skip(f"no native library here: {build.status()}")
        native_dequantize.install(lib)
    return request.param


def _assert_bit_identical(raw: np.ndarray, qtype: int, got: torch.Tensor) -> None:
    want = reference.dequantize(raw, qtype).reshape(got.shape)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), f"{T(qtype).name} differs"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(qtype, shape, dequantizer):
    raw = _random_rows(qtype, *shape)
    got = dequantize(torch.from_numpy(raw), qtype)
    assert got.shape == shape
    _assert_bit_identical(raw, qtype, got)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_match_gguf_py(qtype, dequantizer):
    raw = _quantized_rows(qtype, 7, 512)
    _assert_bit_identical(raw, qtype, dequantize(torch.from_numpy(raw), qtype))


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q5_1, T.Q3_K, T.Q6_K], ids=lambda t: t.name)
def test_chunks_cover_the_tensor(qtype, monkeypatch, dequantizer):
    """Steps of 3 blocks (1 for the 256-value K blocks): steps that split rows and a ragged last step."""
    monkeypatch.setattr(quants, "CHUNK_VALUES", 96)
    raw = _random_rows(qtype, 5, 768, seed=1)
    _assert_bit_identical(raw, qtype, dequantize(torch.from_numpy(raw), qtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_half_output_is_the_float32_result_cast(qtype, dtype):
    raw = torch.from_numpy(_quantized_rows(qtype, 3, 512) if qtype in QUANTIZABLE else _random_rows(qtype, 3, 512))
    got = dequantize(raw, qtype, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize(raw, qtype).to(dtype))


def test_shape_and_row_bytes():
    raw = torch.from_numpy(_random_rows(T.Q4_K, 4, 512))
    assert row_bytes(T.Q4_K, 512) == raw.shape[1] == 288
    assert dequantize(raw, T.Q4_K, shape=(2, 2, 512)).shape == (2, 2, 512)
    assert dequantize(raw.reshape(-1), T.Q4_K).shape == (1, 2048)    # 1-D: one row
    with pytest.raises(ValueError):
        row_bytes(T.Q4_K, 300)


def test_unsupported_type_is_a_one_line_load_error():
    check_supported(T.Q6_K, "output.weight")    # supported: no error
    with pytest.raises(ModelLoadError) as error:
        check_supported(T.IQ2_XXS, "blk.3.ffn_down.weight")
    message = str(error.value)
    assert "\n" not in message
    assert "blk.3.ffn_down.weight" in message and "IQ2_XXS" in message and "Q4_K" in message


def _parts(spec: list[tuple[T, int]], in_features: int) -> list[tuple[np.ndarray, T]]:
    return [(_quantized_rows(q, rows, in_features, seed=i) if q in QUANTIZABLE
             else _random_rows(q, rows, in_features, seed=i), q) for i, (q, rows) in enumerate(spec)]


def test_linear_of_parts_in_different_types():
    """A fused qkv layer as real files have it: q and k Q5_0, v Q8_0."""
    parts = _parts([(T.Q5_0, 64), (T.Q5_0, 32), (T.Q8_0, 32)], 256)
    weight = torch.from_numpy(np.concatenate([reference.dequantize(raw, q) for raw, q in parts]))
    bias = torch.randn(128)
    layer = GGUFLinear([(torch.from_numpy(raw), q) for raw, q in parts], 256, bias=bias)
    assert (layer.out_features, layer.in_features) == (128, 256)
    assert [q for _, q in layer.parts] == [T.Q5_0, T.Q5_0, T.Q8_0]
    assert torch.equal(layer.dequantized(torch.float32), weight)

    x = torch.randn(5, 256)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    xb = x.bfloat16()
    assert torch.equal(layer(xb), F.linear(xb, weight.bfloat16(), bias.bfloat16()))


def test_linear_parts_are_buffers_that_move_with_the_module():
    parts = _parts([(T.Q4_K, 8), (T.Q6_K, 4)], 512)
    layer = GGUFLinear([(torch.from_numpy(raw), q) for raw, q in parts], 512)
    assert {name for name, _ in layer.named_buffers()} == {"part0", "part1"}
    moved = layer.to("meta")
    assert all(raw.device.type == "meta" for raw, _ in moved.parts)
    with pytest.raises(ValueError):   # rows of the wrong width
        GGUFLinear([(torch.from_numpy(parts[0][0]), T.Q4_K)], 256)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_matches_gguf_py(qtype):
    raw = _random_rows(qtype, 7, 512)
    _assert_bit_identical(raw, qtype, dequantize(torch.from_numpy(raw).cuda(), qtype).cpu())


# -- the real files -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_file_tensors_match_gguf_py(name, dequantizer):
    """Every type in each real file, a few tensors each (the file read by pagedchat's own reader: gguf-py's
    takes up to 40 s to parse Gemma's vocabulary)."""
    from pagedchat.model.gguf.reader import open_gguf

    by_type = {}
    for tensor in open_gguf([real_file(name)]).tensors.values():
        by_type.setdefault(tensor.qtype, []).append(tensor)
    assert set(by_type) <= SUPPORTED
    for qtype, tensors in by_type.items():
        for tensor in tensors[:3]:
            raw = tensor.data[:64]   # [rows, row_bytes]: the big embeddings' first rows are enough
            _assert_bit_identical(raw, qtype, dequantize(torch.from_numpy(raw), qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_an_embedding_kept_as_blocks_looks_up_the_dequantized_rows(qtype):
    """GGUFEmbedding dequantizes only the rows a lookup reads, bit for bit the whole table's rows."""
    from pagedchat.model.gguf.embedding import GGUFEmbedding

    raw = torch.from_numpy(_random_rows(qtype, 40, 512, seed=2))
    table = GGUFEmbedding(raw, qtype, 512)
    ids = torch.tensor([[3, 39, 0], [3, 17, 5]])
    got = table(ids)
    assert got.shape == (2, 3, 512)
    assert np.array_equal(got.numpy().view(np.int32), dequantize(raw, qtype)[ids].numpy().view(np.int32))


def test_a_large_layer_runs_a_slice_of_rows_at_a_time(monkeypatch):
    """GGUFLinear's forward on more rows than CHUNK_ROWS (parts of several types, slices across parts) equals the
    whole dequantized weight's product."""
    from pagedchat.model.gguf import linear

    monkeypatch.setattr(linear, "CHUNK_ROWS", 8)
    parts = [(torch.from_numpy(_random_rows(T.Q8_0, 13, 64, seed=3)), int(T.Q8_0)),
             (torch.from_numpy(_random_rows(T.Q4_0, 6, 64, seed=4)), int(T.Q4_0))]
    layer = GGUFLinear(parts, 64, torch.randn(19))
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantized(), layer.bias), rtol=1e-5, atol=1e-4)
