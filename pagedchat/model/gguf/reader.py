"""Open a GGUF file (or a split set) memory-mapped: its metadata as plain Python values and its tensors as raw
byte views of the file, never copied.

The header is parsed here rather than with gguf-py's GGUFReader: that reader builds a numpy array per element
of every metadata array, and a 262k-token vocabulary (Gemma 3) then takes 15-40 s to open, against llama.cpp's
half a second. Numeric arrays are read with one `np.frombuffer`; only strings need a loop, and a header with a
vocabulary is parsed once per file (header_cache.py keeps it between processes). gguf-py stays the reference
the tests compare against (and the writer they make files with).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from pagedchat.errors import ModelLoadError
from pagedchat.model.gguf import header_cache
from pagedchat.model.gguf.locate import looks_like_gguf

DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> numpy dtypes (8 = string, 9 = array are handled apart).
_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
_STRING, _ARRAY = 8, 9

class GGMLType(IntEnum):
    """ggml's tensor type numbers, as GGUF files store them (gguf-py's GGMLQuantizationType, without importing
    gguf-py and its 0.3 s on every start)."""
    F32 = 0; F16 = 1; Q4_0 = 2; Q4_1 = 3; Q5_0 = 6; Q5_1 = 7; Q8_0 = 8; Q8_1 = 9  # noqa: E702
    Q2_K = 10; Q3_K = 11; Q4_K = 12; Q5_K = 13; Q6_K = 14; Q8_K = 15  # noqa: E702
    IQ2_XXS = 16; IQ2_XS = 17; IQ3_XXS = 18; IQ1_S = 19; IQ4_NL = 20; IQ3_S = 21; IQ2_S = 22  # noqa: E702
    IQ4_XS = 23; I8 = 24; I16 = 25; I32 = 26; I64 = 27; F64 = 28; IQ1_M = 29; BF16 = 30  # noqa: E702
    TQ1_0 = 34; TQ2_0 = 35; MXFP4 = 39  # noqa: E702


# Values and bytes per block of each tensor type, for the size of a tensor's data.
BLOCKS = {GGMLType(t): size for t, size in {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17)}.items()}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: int                 # ggml's type number (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]     # torch order: (rows, columns) for a matrix
    data: np.ndarray           # the file's bytes, uint8 [rows, row_bytes] (rows = product of all but the last dim)


@dataclass
class GGUFFile:
    paths: list[Path]
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """An architecture key without its prefix (`get("block_count")`), or a full key."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def open_gguf(paths: list[Path]) -> GGUFFile:
    """Every part of a GGUF model: metadata from the first part, tensors from all of them."""
    metadata: dict[str, object] = {}
    tensors: dict[str, GGUFTensor] = {}
    for i, path in enumerate(paths):
        part_meta, part_tensors = _read_part(path)
        if i == 0:
            metadata = part_meta
        tensors.update(part_tensors)
    expected = metadata.get("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise ModelLoadError(f"{paths[0]}: the split set holds {len(tensors)} of its {expected} tensors "
                             f"(a part is missing)")
    return GGUFFile(list(paths), metadata, tensors)


def _read_part(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} not found")
    if not looks_like_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, the file never written
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    try:
        return _parse(buf, path)
    except (struct.error, ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(f"{path} is truncated or damaged (its header cannot be read: {e})") from None


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.mem, self.pos = buf, memoryview(buf), 0
        self.strings_read = 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.mem, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.mem[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: string() unrolled with its lookups hoisted (a 262k-token vocabulary is
        most of a header's parse time)."""
        mem, pos, end, length = self.mem, self.pos, len(self.buf), _U64.unpack_from
        out = [""] * count
        self.strings_read += count
        for i in range(count):
            n = length(mem, pos)[0]
            pos += 8
            if pos + n > end:
                raise ValueError("a string runs past the end of the file")
            out[i] = str(mem[pos:pos + n], "utf-8", "replace")
            pos += n
        self.pos = pos
        return out

    def array(self, dtype: str, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.pos + size > len(self.buf):
            raise ValueError("an array runs past the end of the file")
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += size
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return self.strings(count)
            if item in _SCALAR:
                return self.array(_SCALAR[item], count).tolist()
            raise ValueError(f"metadata array of unknown type {item}")
        if kind in _SCALAR:
            return self.array(_SCALAR[kind], 1).tolist()[0]
        raise ValueError(f"metadata value of unknown type {kind}")


def _parse(buf: np.ndarray, path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        swapped = version.to_bytes(4, "little") == (3).to_bytes(4, "big")
        raise ModelLoadError(f"{path}: GGUF version {version} is not read (versions 2 and 3 are)"
                             + ("; this is a big-endian file" if swapped else ""))
    header = header_cache.load(path)
    if header is None:
        header = _header(cur)
        header_cache.store(path, header, cur.strings_read)
    metadata, infos, end = header
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-end // align) * align
    return metadata, {name: _tensor(buf, path, name, dims, qtype, start + offset)
                      for name, dims, qtype, offset in infos}


def _header(cur: _Cursor) -> tuple[dict[str, object], list[tuple], int]:
    """(metadata, (name, dims, type, offset) per tensor, where the tensor data's alignment starts counting),
    read from just after the version: plain values, as header_cache keeps them."""
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    return metadata, infos, cur.pos


def _tensor(buf: np.ndarray, path: Path, name: str, dims: list[int], qtype: int, offset: int) -> GGUFTensor:
    if qtype not in BLOCKS:
        raise ModelLoadError(f"{path}: tensor {name} has tensor type {qtype}, which this version does not know")
    values, nbytes = BLOCKS[qtype]
    columns = dims[0] if dims else 1
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    if columns % values:
        raise ModelLoadError(f"{path}: tensor {name} has rows of {columns} values, not whole blocks of {values}")
    row_bytes = columns // values * nbytes
    end = offset + rows * row_bytes
    if end > len(buf):
        raise ModelLoadError(f"{path} is truncated: tensor {name} ends at byte {end:,}, the file has "
                             f"{len(buf):,} bytes")
    data = buf[offset:end].reshape(rows, row_bytes)
    return GGUFTensor(name, qtype, tuple(reversed(dims)), data)
