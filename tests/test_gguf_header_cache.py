"""A GGUF header with a vocabulary is parsed once per file and read back from header_cache afterwards: the same
metadata and tensors, never from an entry of another or a changed file, and a damaged entry is only a parse."""

from __future__ import annotations

import marshal
import os
import shutil

import numpy as np
import pytest

from gguf_models import finish_writer
from pagedchat.model.gguf import header_cache
from pagedchat.model.gguf.reader import open_gguf


def write_file(path, tokens: int, seed: int = 0):
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("general.name", "header cache test")
    w.add_token_list([f"tok{i}" for i in range(tokens)])
    w.add_token_scores(rng.normal(size=tokens).astype(np.float32).tolist())
    w.add_tensor("token_embd.weight", rng.normal(size=(8, 32)).astype(np.float32))
    finish_writer(w)
    return path


def entries():
    folder = header_cache.cache_dir()
    return sorted(folder.glob("*.marshal")) if folder.is_dir() else []


def same(a, b) -> None:
    assert a.metadata == b.metadata
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.shape) == (u.qtype, u.shape) and np.array_equal(t.data, u.data)


def test_a_vocabulary_header_is_kept_and_read_back_unchanged(tmp_path, monkeypatch):
    path = write_file(tmp_path / "vocab.gguf", header_cache.MIN_STRINGS)
    parsed = open_gguf([path])
    assert len(entries()) == 1
    parses = []
    monkeypatch.setattr("pagedchat.model.gguf.reader._header", lambda cur: parses.append(1))
    same(open_gguf([path]), parsed)
    assert not parses, "the second open parsed the header again"


def test_a_small_header_is_not_kept(tmp_path):
    open_gguf([write_file(tmp_path / "small.gguf", 100)])
    assert entries() == []


def test_a_changed_or_replaced_file_is_parsed_again(tmp_path):
    path = write_file(tmp_path / "vocab.gguf", header_cache.MIN_STRINGS)
    open_gguf([path])
    other = write_file(tmp_path / "other.gguf", header_cache.MIN_STRINGS + 5, seed=1)
    shutil.copyfile(other, path)   # same name, other contents
    same(open_gguf([path]), open_gguf([other]))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert len(open_gguf([path]).metadata["tokenizer.ggml.tokens"]) == header_cache.MIN_STRINGS + 5


@pytest.mark.parametrize("damage", [b"", b"\x00garbage", marshal.dumps(42), marshal.dumps(({}, [], "x")), None])
def test_a_damaged_entry_is_only_a_parse(tmp_path, damage):
    path = write_file(tmp_path / "vocab.gguf", header_cache.MIN_STRINGS)
    parsed = open_gguf([path])
    (entry,) = entries()
    if damage is None:
        entry.write_bytes(entry.read_bytes()[:1000])   # cut short
    else:
        entry.write_bytes(damage)
    same(open_gguf([path]), parsed)


def test_a_cache_folder_that_cannot_be_written_costs_nothing_but_the_parse(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    path = write_file(tmp_path / "vocab.gguf", header_cache.MIN_STRINGS)
    same(open_gguf([path]), open_gguf([path]))
