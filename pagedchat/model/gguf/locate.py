"""Find the GGUF files a user already has, by the names they know them by.

A reference names a GGUF model in one of three ways:
  path/to/model.gguf        a file; a split set (NAME-00001-of-0000N.gguf) by any of its parts
  ollama:NAME[:TAG]         Ollama's store ($OLLAMA_MODELS, else ~/.ollama/models); TAG defaults to latest
  org/repo:QUANT            a GGUF repository in the local HF cache, the file whose name carries QUANT
LM Studio's folder has no names of its own: its files are listed here and opened by path.

Other tools' stores are only read, never written. Everything here is plain file-system work (no torch, no
numpy): `Registry.resolve` calls it for every -m, and `models list` for every store.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagedchat import dirs
from pagedchat.errors import ModelLoadError

MAGIC = b"GGUF"
OLLAMA = "ollama:"
OLLAMA_HOST, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"     # what a bare Ollama name stands for
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"

# llama.cpp's split naming (gguf-split): "%s-%05d-of-%05d.gguf"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})(?P<ext>\.gguf)$", re.IGNORECASE)
# org/repo:QUANT, optionally written hf:org/repo:QUANT as models.toml sources may be
_HF_QUANT = re.compile(r"^(?:hf:)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>[\w.-]+)$")
# A digest names a file under blobs/: anything but hex could climb out of the store.
_DIGEST = re.compile(r"^sha256[:-](?P<hex>[0-9a-fA-F]+)$")
# The quantization label llama.cpp's tools and the big GGUF publishers put in file names.
_QUANT_LABEL = re.compile(r"(?<![A-Za-z0-9])(?:UD-)?(?:I?Q[1-8](?:_[A-Za-z0-9]+)*|TQ[12]_0|B?F16|F32|MXFP4(?:_MOE)?)"
                          r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass
class LocalGGUF:
    name: str       # the reference that opens it: ollama:NAME:TAG, org/repo:QUANT, or its path
    path: Path      # the file (a split set's first part)
    size: int       # bytes, all parts of a split set together
    where: str      # "ollama", "hf-cache" or "lmstudio"


# -- references ---------------------------------------------------------------------------------------------------

def is_gguf_reference(reference: str) -> bool:
    """Whether `reference` names a GGUF model rather than an HF folder or repo id. At most a stat (and the
    first four bytes of an existing file without the .gguf suffix, such as an Ollama blob given by path)."""
    if reference.startswith(OLLAMA) or reference.lower().endswith(".gguf"):
        return True
    path = Path(reference).expanduser()
    if path.is_file():
        return looks_like_gguf(path)
    return bool(_HF_QUANT.match(reference)) and not path.is_dir()


def resolve_gguf(reference: str) -> list[Path] | None:
    """The GGUF file(s) `reference` names, every part of a split set in order; None when it is no GGUF
    reference at all (an HF folder or org/repo id: the safetensors path opens those). One-line
    ModelLoadError when it is one but names nothing usable."""
    if reference.startswith(OLLAMA):
        return [ollama_blob(reference[len(OLLAMA):])]
    path = Path(reference).expanduser()
    if path.is_file():     # a file is GGUF by its name or its first bytes, whatever else its name looks like
        return split_set(path) if path.suffix.lower() == ".gguf" or looks_like_gguf(path) else None
    quant = _HF_QUANT.match(reference)
    if quant and not path.is_dir():
        return hf_cache_gguf(quant["repo"], quant["quant"])
    if reference.lower().endswith(".gguf"):
        return split_set(path)          # says which file (or which part) is missing
    return None


def split_set(path: Path) -> list[Path]:
    """All parts of the split set `path` belongs to (any part names the set), or [path] for a single file;
    absolute, but links not followed (an HF snapshot's names are links to blobs named by hash)."""
    path = path.absolute()
    parts = _set_parts(path)
    if path.is_dir():
        raise ModelLoadError(f"{path} is a folder, not a GGUF file")
    if not path.exists() and not any(p.is_file() for p in parts):
        raise ModelLoadError(f"no such GGUF file: {path}")
    for number, part in enumerate(parts, 1):
        if not part.is_file():
            raise ModelLoadError(f"split GGUF {parts[0].name} is missing part {number} of {len(parts)}: {part}")
    return parts


def _set_parts(path: Path) -> list[Path]:
    """The file names of the split set `path` belongs to, present or not; [path] when it is not a part."""
    m = _SPLIT.match(path.name)
    if not m or not 1 <= int(m["part"]) <= int(m["total"]):
        return [path]
    total = int(m["total"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{total:05d}{m['ext']}") for i in range(1, total + 1)]


def looks_like_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes (what names it a GGUF, whatever its file name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# -- Ollama -------------------------------------------------------------------------------------------------------

def ollama_store() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_blob(name: str) -> Path:
    """The GGUF blob of an Ollama model NAME[:TAG]: its manifest's model layer, read from the store."""
    store = ollama_store()
    host, namespace, model, tag = _ollama_parts(name)
    manifest = store / "manifests" / host / namespace / model / tag
    if not manifest.is_file():
        raise ModelLoadError(_ollama_not_found(store, manifest, _ollama_short(host, namespace, model), tag))
    digest = _model_digest(_read_manifest(manifest), manifest)
    blob = store / "blobs" / f"sha256-{_DIGEST.match(digest)['hex']}"
    if not blob.is_file():
        raise ModelLoadError(f"Ollama model {OLLAMA}{_ollama_short(host, namespace, model)}:{tag} is missing its "
                             f"weights blob {blob} (an interrupted pull? `ollama pull` fetches it again)")
    return blob


def ollama_reference_for(name: str) -> str | None:
    """`ollama:NAME` when a bare NAME[:TAG] (as `ollama run` takes it) is in the Ollama store: a hint for a
    user who forgot the prefix."""
    try:
        host, namespace, model, tag = _ollama_parts(name)
    except ModelLoadError:
        return None
    manifest = ollama_store() / "manifests" / host / namespace / model / tag
    return OLLAMA + name if manifest.is_file() else None


def _ollama_parts(name: str) -> tuple[str, str, str, str]:
    """NAME[:TAG] as Ollama reads it: MODEL, NS/MODEL or HOST/NS/MODEL; the tag follows the last slash."""
    path, _, last = name.rpartition("/")
    model, _, tag = last.partition(":")
    parts = (path.split("/") if path else []) + [model]
    if any(not p or p in (".", "..") for p in parts + [tag or "latest"]) or len(parts) > 3:
        raise ModelLoadError(f"{OLLAMA}{name} is not an Ollama model name (NAME, NAMESPACE/NAME or "
                             f"HOST/NAMESPACE/NAME, then an optional :TAG)")
    host, namespace = {1: (OLLAMA_HOST, OLLAMA_NAMESPACE), 2: (OLLAMA_HOST, parts[0])}.get(len(parts), parts[:2])
    return host, namespace, parts[-1], tag or "latest"


def _ollama_short(host: str, namespace: str, model: str) -> str:
    """The name as `ollama list` prints it: the default host and namespace left out."""
    if host != OLLAMA_HOST:
        return f"{host}/{namespace}/{model}"
    return model if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}"


def _ollama_not_found(store: Path, manifest: Path, short: str, tag: str) -> str:
    if not (store / "manifests").is_dir():
        return (f"Ollama model {OLLAMA}{short}:{tag} not found: no Ollama store at {store} "
                f"(set OLLAMA_MODELS if it is elsewhere)")
    try:
        tags = sorted(p.name for p in manifest.parent.iterdir() if p.is_file())
    except OSError:         # no such model at all (or a folder we may not read): no tags to offer
        tags = []
    if tags:
        return f"Ollama has no tag {tag!r} of {short} (it has: {', '.join(tags)}; looked in {manifest.parent})"
    return f"Ollama model {OLLAMA}{short}:{tag} not found (no manifest {manifest}; `ollama list` shows what is pulled)"


def _read_manifest(manifest: Path) -> dict:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not JSON"
        raise ModelLoadError(f"cannot read Ollama manifest {manifest}: {reason}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read Ollama manifest {manifest}: not a JSON object")
    return data


def _model_digest(data: dict, manifest: Path) -> str:
    """The digest of the manifest's model layer (the GGUF; other layers hold the template, params, license)."""
    layers = data.get("layers")
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = layer.get("digest")
            if isinstance(digest, str) and _DIGEST.match(digest):
                return digest
            raise ModelLoadError(f"Ollama manifest {manifest}: the model layer's digest {digest!r} is "
                                 f"not sha256:<hex>")
    raise ModelLoadError(f"Ollama manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER}): not "
                         f"a model pagedchat can open")


def _ollama_models() -> list[LocalGGUF]:
    root = ollama_store() / "manifests"
    found = []
    for manifest in sorted(root.glob("*/*/*/*")):            # HOST/NAMESPACE/MODEL/TAG
        host, namespace, model, tag = manifest.relative_to(root).parts
        name = f"{_ollama_short(host, namespace, model)}:{tag}"
        try:
            blob = ollama_blob(name)     # the same checks as opening it: what is listed opens
            found.append(LocalGGUF(OLLAMA + name, blob, blob.stat().st_size, "ollama"))
        except (ModelLoadError, OSError):     # a half-pulled or odd model: left out, never the whole list
            continue
    return found


# -- the local HF cache -------------------------------------------------------------------------------------------

def hf_cache() -> Path:
    """The hub cache folder as huggingface_hub finds it (read at each call: the environment may change)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    return Path(os.environ.get("HF_HOME") or dirs.cache_home() / "huggingface").expanduser() / "hub"


def hf_cache_gguf(repo: str, quant: str) -> list[Path]:
    """The GGUF file (or split set) of `repo`'s current snapshot whose name carries `quant`."""
    folder = hf_cache() / f"models--{repo.replace('/', '--')}"
    snapshot = _current_snapshot(folder)
    if snapshot is None:
        raise ModelLoadError(f"{repo} is not in the local HF cache (looked for {folder})")
    sets = _gguf_sets(snapshot, "**/*.gguf")
    if not sets:
        raise ModelLoadError(f"{repo} in the local HF cache has no GGUF files (snapshot {snapshot})")
    matches = _carrying(quant, sets, snapshot)
    names = ", ".join(_relative(s[0], snapshot) for s in (matches or sets))
    if not matches:
        raise ModelLoadError(f"no GGUF file of {repo} carries {quant!r} in its name (it has: {names})")
    if len(matches) > 1:
        raise ModelLoadError(f"{quant!r} matches several GGUF files of {repo}: {names}; name one by more of its name")
    return split_set(matches[0][0])


def _current_snapshot(folder: Path) -> Path | None:
    """refs/main's snapshot; without it the newest snapshot (a cache filled by revision only)."""
    try:
        snapshot = folder / "snapshots" / (folder / "refs" / "main").read_text().strip()
        if snapshot.is_dir():
            return snapshot
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    try:
        snapshots = [p for p in (folder / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _carrying(quant: str, sets: list[list[Path]], snapshot: Path) -> list[list[Path]]:
    """The sets whose path carries `quant` as a whole label (Q4_K not inside Q4_K_M, F16 not inside BF16), else
    anywhere in the name (model_q4_k_m.gguf); case-insensitive."""
    whole = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    anywhere = re.compile(re.escape(quant), re.IGNORECASE)
    for pattern in (whole, anywhere):
        matches = [s for s in sets if pattern.search(_relative(s[0], snapshot))]
        if matches:
            return matches
    return []


def _hf_models() -> list[LocalGGUF]:
    found = []
    for folder in sorted(hf_cache().glob("models--*")):
        snapshot = _current_snapshot(folder)
        if snapshot is None:
            continue
        repo = folder.name[len("models--"):].replace("--", "/")
        sets = _gguf_sets(snapshot, "**/*.gguf")
        for parts in _complete(sets):
            name = _hf_name(repo, parts, sets, snapshot) or str(parts[0])
            found.append(LocalGGUF(name, parts[0], _size(parts), "hf-cache"))
    return found


def _hf_name(repo: str, parts: list[Path], sets: list[list[Path]], snapshot: Path) -> str | None:
    """org/repo:LABEL that opens exactly this set: its quant label, else its whole file name."""
    if "/" not in repo:
        return None                 # an id without an org has no org/repo:QUANT form: listed by path
    stem = _SPLIT.sub(r"\g<stem>", parts[0].name)
    stem = stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    labels = [m.group(0) for m in _QUANT_LABEL.finditer(stem)][-1:] + [stem]
    for label in labels:
        if _HF_QUANT.match(f"{repo}:{label}") and _carrying(label, sets, snapshot) == [parts]:
            return f"{repo}:{label}"
    return None


def _relative(path: Path, folder: Path) -> str:
    return path.relative_to(folder).as_posix()


# -- LM Studio ----------------------------------------------------------------------------------------------------

def lmstudio_folders() -> list[Path]:
    """LM Studio's models folders: its home as ~/.lmstudio-home-pointer names it (LM Studio writes that file),
    ~/.lmstudio, and ~/.cache/lm-studio (older versions). LM Studio documents no environment variable."""
    home = Path.home()
    homes = [home / ".lmstudio", home / ".cache" / "lm-studio"]
    try:
        pointed = (home / ".lmstudio-home-pointer").read_text().strip()
        if pointed:
            homes.insert(0, Path(pointed).expanduser())
    except (OSError, UnicodeDecodeError):
        pass
    folders, seen = [], set()
    for folder in (h / "models" for h in homes):
        key = os.path.realpath(folder)
        if key not in seen:
            seen.add(key)
            folders.append(folder)
    return folders


def _lmstudio_models() -> list[LocalGGUF]:
    found = []
    for folder in lmstudio_folders():
        for parts in _complete(_gguf_sets(folder, "*/*/*.gguf")):      # PUBLISHER/REPO/FILE.gguf
            found.append(LocalGGUF(str(parts[0]), parts[0], _size(parts), "lmstudio"))
    return found


# -- listing ------------------------------------------------------------------------------------------------------

def gguf_stores() -> list[tuple[str, Path]]:
    """Where `list_local_ggufs` looks, as (where, folder)."""
    return ([("ollama", ollama_store()), ("hf-cache", hf_cache())]
            + [("lmstudio", folder) for folder in lmstudio_folders()])


def list_local_ggufs() -> list[LocalGGUF]:
    """Every GGUF model in Ollama's store, the local HF cache and LM Studio's folders, each by the name that
    opens it; a split set once, with the size of all its parts. A store that is missing or odd adds nothing."""
    found = []
    for scan in (_ollama_models, _hf_models, _lmstudio_models):
        try:
            found += scan()
        except OSError:
            continue
    return found


def _gguf_sets(folder: Path, pattern: str) -> list[list[Path]]:
    """The GGUF files under `folder` grouped into sets (a split set by its parts' names, present or not),
    vision projectors (mmproj-*) left out: they are no language model."""
    sets: dict[Path, list[Path]] = {}
    try:
        files = sorted(folder.glob(pattern))
    except OSError:
        return []
    for file in files:
        if not file.name.lower().startswith("mmproj"):
            parts = _set_parts(file)
            sets.setdefault(parts[0], parts)
    return list(sets.values())


def _complete(sets: list[list[Path]]) -> list[list[Path]]:
    """The sets whose every part is there (a broken HF symlink or a half-downloaded split set is no model)."""
    return [parts for parts in sets if all(p.is_file() for p in parts)]


def _size(parts: list[Path]) -> int:
    return sum(p.stat().st_size for p in parts)
