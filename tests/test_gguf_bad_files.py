"""Bad GGUF files a user can have: each is one line on stderr and exit code 2, no traceback (missing, not a
GGUF, truncated in the header or in the tensor data, an architecture or tensor type pagedchat does not run,
--quantize int8 on a file that is already quantized)."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_models import build_hf, finish_writer, write_gguf
from test_bad_input import assert_one_line


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-ok")
    path = root / "model.gguf"
    write_gguf(build_hf("llama", root), root, path, "llama", "Q8_0")
    return path


def test_a_good_file_answers(pagedchat_cli, good_file):
    code, out, err = pagedchat_cli("run", "-m", str(good_file), "--max-tokens", "4", "--temperature", "0", "hi")
    assert code == 0, err


def test_missing_file(pagedchat_cli, tmp_path):
    code, _, err = pagedchat_cli("run", "-m", str(tmp_path / "nope.gguf"), "hi")
    assert_one_line(code, err, "nope.gguf")


def test_wrong_magic(pagedchat_cli, tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    code, _, err = pagedchat_cli("run", "-m", str(path), "hi")
    assert_one_line(code, err, "fake.gguf")


@pytest.mark.parametrize("keep", [10, 2000, -100])   # in the header, in the tensor table, in the last tensor
def test_truncated_files(pagedchat_cli, good_file, tmp_path, keep):
    data = good_file.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    code, _, err = pagedchat_cli("run", "-m", str(path), "hi")
    assert_one_line(code, err, "cut.gguf")
    assert "truncated" in err or "damaged" in err or "GGUF" in err, err


def test_unsupported_architecture(pagedchat_cli, tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish_writer(w)
    code, _, err = pagedchat_cli("run", "-m", str(path), "hi")
    assert_one_line(code, err, "'bert'", "supported")


def test_unsupported_tensor_type(pagedchat_cli, tmp_path, good_file):
    """A tensor in a format pagedchat does not read (IQ4_NL here) names the tensor and its type."""
    import gguf

    from pagedchat.model.gguf.reader import open_gguf

    source = open_gguf([good_file])
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in source.metadata.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            _copy_field(w, key, value)
    for t in source.tensors.values():
        if t.name == "blk.0.ffn_down.weight":   # 128 wide: 4 blocks of IQ4_NL (18 bytes / 32 values)
            w.add_tensor(t.name, np.zeros((t.shape[0], t.shape[1] // 32 * 18), dtype=np.uint8),
                         raw_shape=(t.shape[0], t.shape[1] // 32 * 18), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=gguf.GGMLQuantizationType(t.qtype))
    finish_writer(w)
    code, _, err = pagedchat_cli("run", "-m", str(path), "hi")
    assert_one_line(code, err, "blk.0.ffn_down.weight", "IQ4_NL")


def _copy_field(w, key, value):
    import gguf

    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)


def test_quantize_int8_on_a_quantized_file(pagedchat_cli, good_file):
    code, _, err = pagedchat_cli("run", "-m", str(good_file), "--quantize", "int8", "hi")
    assert_one_line(code, err, "already quantized", "--quantize none")
