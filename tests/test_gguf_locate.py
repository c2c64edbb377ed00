"""GGUF references (a .gguf path, ollama:NAME[:TAG], org/repo:QUANT) and the stores they name, built in tmp
folders: Ollama's manifests and blobs, the HF cache's snapshots, LM Studio's folder. No model is loaded."""

import hashlib
import json

import pytest

from pagedchat.errors import ModelLoadError, UserError
from pagedchat.model.gguf.locate import (LocalGGUF, gguf_stores, is_gguf_reference, list_local_ggufs,
                                         resolve_gguf)
from pagedchat.registry import Registry

MODEL_LAYER = "application/vnd.ollama.image.model"


def gguf_bytes(tag: str, size: int = 64) -> bytes:
    return (b"GGUF" + tag.encode()).ljust(size, b"\0")


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Empty Ollama store, HF cache and home (LM Studio's folders live under it), all in tmp."""
    home, ollama, hf = tmp_path / "home", tmp_path / "ollama", tmp_path / "hf"
    for folder in (home, ollama, hf):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    return {"home": home, "ollama": ollama, "hf": hf, "tmp": tmp_path}


def ollama_pull(store, manifest_path: str, content: bytes | None, model_layer: bool = True, blob: bool = True):
    """A model as `ollama pull` leaves it: a manifest (HOST/NS/NAME/TAG) whose layers name blobs by digest."""
    digest = "sha256:" + hashlib.sha256(content or b"").hexdigest()
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "ab" * 32, "size": 3}]
    if model_layer:
        layers.insert(0, {"mediaType": MODEL_LAYER, "digest": digest, "size": len(content)})
    manifest = store / "manifests" / manifest_path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": {"digest": "sha256:" + "cd" * 32},
                                    "layers": layers}))
    path = store / "blobs" / digest.replace(":", "-")
    if model_layer and blob:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
    return path


def hf_snapshot(cache, repo: str, files: dict[str, bytes], revision: str = "a" * 40, main: bool = True):
    """A repo in the HF cache: files in blobs/, linked from snapshots/REV/ as huggingface_hub does."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / revision
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        blob = folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    if main:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def filled(stores):
    """Every kind of store with something in it."""
    o, hf, home = stores["ollama"], stores["hf"], stores["home"]
    stores["llama"] = ollama_pull(o, "registry.ollama.ai/library/llama3.2/latest", gguf_bytes("llama"))
    stores["llama1b"] = ollama_pull(o, "registry.ollama.ai/library/llama3.2/1b", gguf_bytes("llama1b", 80))
    stores["someone"] = ollama_pull(o, "registry.ollama.ai/someone/tiny/latest", gguf_bytes("someone"))
    stores["hfco"] = ollama_pull(o, "hf.co/org/Some-GGUF/Q4_K_M", gguf_bytes("hfco"))
    # An older revision that refs/main no longer names: never chosen.
    hf_snapshot(hf, "org/Tiny-GGUF", {"tiny-Q4_K_M.gguf": gguf_bytes("old")}, revision="b" * 40, main=False)
    stores["snapshot"] = hf_snapshot(hf, "org/Tiny-GGUF", {
        "tiny-Q4_K_M.gguf": gguf_bytes("q4", 100), "tiny-BF16.gguf": gguf_bytes("bf16", 200),
        "tiny-F16.gguf": gguf_bytes("f16", 200), "mmproj-tiny-F16.gguf": gguf_bytes("mmproj"),
        "Q8_0/tiny-Q8_0-00001-of-00002.gguf": gguf_bytes("q8a", 150),
        "Q8_0/tiny-Q8_0-00002-of-00002.gguf": gguf_bytes("q8b", 50), "README.md": b"# tiny"})
    lm = home / ".lmstudio" / "models" / "pub" / "repo"
    lm.mkdir(parents=True)
    (lm / "repo-Q4_0.gguf").write_bytes(gguf_bytes("lm", 70))
    old = home / ".cache" / "lm-studio" / "models" / "pub2" / "other"
    old.mkdir(parents=True)
    (old / "other-00001-of-00002.gguf").write_bytes(gguf_bytes("lm1", 30))
    (old / "other-00002-of-00002.gguf").write_bytes(gguf_bytes("lm2", 40))
    stores["lmstudio"], stores["lmstudio_old"] = lm / "repo-Q4_0.gguf", old / "other-00001-of-00002.gguf"
    return stores


def one_line_error(reference: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        resolve_gguf(reference)
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- what is a GGUF reference ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("reference, expected", [
    ("ollama:llama3.2", True), ("ollama:someone/tiny:latest", True), ("model.gguf", True), ("dir/M.GGUF", True),
    ("org/repo:Q4_K_M", True), ("hf:org/repo:q8_0", True),
    ("org/repo", False), ("demo", False), ("./folder", False), ("hf:org/repo", False), ("llama3.2:1b", False),
])
def test_is_gguf_reference(stores, reference, expected):
    assert is_gguf_reference(reference) is expected


def test_an_existing_folder_or_plain_file_is_no_gguf_reference(stores, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "repo:v2").mkdir(parents=True)            # a folder that only looks like org/repo:QUANT
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "blob").write_bytes(gguf_bytes("x"))              # a GGUF by its magic, whatever its name
    assert not is_gguf_reference("org/repo:v2") and resolve_gguf("org/repo:v2") is None
    assert not is_gguf_reference("notes.txt") and resolve_gguf("notes.txt") is None
    assert is_gguf_reference("blob") and resolve_gguf("blob") == [tmp_path / "blob"]
    assert resolve_gguf("org/repo") is None and resolve_gguf("demo") is None


# -- Ollama ---------------------------------------------------------------------------------------------------------

def test_ollama_tag_defaults_to_latest(filled):
    assert resolve_gguf("ollama:llama3.2") == [filled["llama"]]
    assert resolve_gguf("ollama:llama3.2:latest") == [filled["llama"]]
    assert resolve_gguf("ollama:llama3.2:1b") == [filled["llama1b"]]
    assert filled["llama"].read_bytes().startswith(b"GGUF")


def test_ollama_namespaced_and_hosted_models(filled):
    assert resolve_gguf("ollama:someone/tiny") == [filled["someone"]]
    assert resolve_gguf("ollama:hf.co/org/Some-GGUF:Q4_K_M") == [filled["hfco"]]


def test_ollama_store_defaults_to_home(filled, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS")
    blob = ollama_pull(filled["home"] / ".ollama" / "models", "registry.ollama.ai/library/homed/latest",
                       gguf_bytes("home"))
    assert resolve_gguf("ollama:homed") == [blob]


def test_ollama_unknown_model_or_tag_says_where_it_looked(filled):
    message = one_line_error("ollama:nothere")
    assert "ollama:nothere:latest" in message and str(filled["ollama"]) in message
    message = one_line_error("ollama:llama3.2:70b")
    assert "'70b'" in message and "1b, latest" in message and str(filled["ollama"]) in message
    assert "not an Ollama model name" in one_line_error("ollama:a/b/c/d")


def test_ollama_without_a_store(stores, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(stores["tmp"] / "absent"))
    message = one_line_error("ollama:llama3.2")
    assert "no Ollama store at" in message and "absent" in message and "OLLAMA_MODELS" in message


def test_ollama_missing_blob_and_missing_model_layer(stores):
    blob = ollama_pull(stores["ollama"], "registry.ollama.ai/library/half/latest", gguf_bytes("half"), blob=False)
    message = one_line_error("ollama:half")
    assert "missing" in message and str(blob) in message
    ollama_pull(stores["ollama"], "registry.ollama.ai/library/nolayer/latest", None, model_layer=False)
    message = one_line_error("ollama:nolayer")
    assert "no model layer" in message and MODEL_LAYER in message


def test_ollama_unreadable_manifest_is_one_line_and_left_out_of_the_list(filled):
    bad = filled["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    evil = filled["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    evil.parent.mkdir(parents=True)
    evil.write_text(json.dumps({"layers": [{"mediaType": MODEL_LAYER, "digest": "sha256:../../x"}]}))
    assert "cannot read Ollama manifest" in one_line_error("ollama:broken")
    assert "not sha256:<hex>" in one_line_error("ollama:evil")
    names = {g.name for g in list_local_ggufs()}
    assert "ollama:llama3.2:latest" in names and not any("broken" in n or "evil" in n for n in names)


# -- the HF cache ---------------------------------------------------------------------------------------------------

def test_hf_cache_quant_picks_the_file_of_refs_main(filled):
    snapshot = filled["snapshot"]
    assert resolve_gguf("org/Tiny-GGUF:Q4_K_M") == [snapshot / "tiny-Q4_K_M.gguf"]
    assert resolve_gguf("org/Tiny-GGUF:q4_k_m") == [snapshot / "tiny-Q4_K_M.gguf"]      # any case
    assert resolve_gguf("hf:org/Tiny-GGUF:Q4_K_M") == [snapshot / "tiny-Q4_K_M.gguf"]
    assert resolve_gguf("org/Tiny-GGUF:F16") == [snapshot / "tiny-F16.gguf"]   # not BF16, not the mmproj
    assert resolve_gguf("org/Tiny-GGUF:Q8_0") == [snapshot / "Q8_0" / f"tiny-Q8_0-0000{i}-of-00002.gguf"
                                                  for i in (1, 2)]


def test_hf_cache_without_refs_main_takes_the_newest_snapshot(stores):
    snapshot = hf_snapshot(stores["hf"], "org/NoRef-GGUF", {"x-Q4_0.gguf": gguf_bytes("x")}, main=False)
    assert resolve_gguf("org/NoRef-GGUF:Q4_0") == [snapshot / "x-Q4_0.gguf"]


def test_hf_cache_quant_missing_or_ambiguous_lists_the_candidates(filled):
    message = one_line_error("org/Tiny-GGUF:Q5_K_S")
    assert "'Q5_K_S'" in message
    for name in ("tiny-Q4_K_M.gguf", "tiny-BF16.gguf", "Q8_0/tiny-Q8_0-00001-of-00002.gguf"):
        assert name in message
    assert "mmproj" not in message and "00002-of" not in message
    message = one_line_error("org/Tiny-GGUF:16")
    assert "several" in message and "tiny-F16.gguf" in message and "tiny-BF16.gguf" in message
    assert "not in the local HF cache" in one_line_error("org/Absent-GGUF:Q4_K_M")
    hf_snapshot(filled["hf"], "org/safetensors-only", {"model.safetensors": b"x"})
    assert "no GGUF files" in one_line_error("org/safetensors-only:Q4_K_M")


def test_hf_cache_split_set_with_a_missing_part(stores):
    hf_snapshot(stores["hf"], "org/Half-GGUF", {"big-Q4_0-00001-of-00003.gguf": gguf_bytes("1"),
                                                "big-Q4_0-00003-of-00003.gguf": gguf_bytes("3")})
    message = one_line_error("org/Half-GGUF:Q4_0")
    assert "missing part 2 of 3" in message and "big-Q4_0-00002-of-00003.gguf" in message


# -- paths and split sets -------------------------------------------------------------------------------------------

def test_split_set_by_any_part_and_a_missing_part(tmp_path):
    parts = [tmp_path / f"m-Q4_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for part in parts:
        part.write_bytes(gguf_bytes(part.name))
    assert resolve_gguf(str(parts[0])) == parts
    assert resolve_gguf(str(parts[2])) == parts
    single = tmp_path / "single.gguf"
    single.write_bytes(gguf_bytes("single"))
    assert resolve_gguf(str(single)) == [single]
    parts[1].unlink()
    for given in (parts[0], parts[1], parts[2]):
        message = one_line_error(str(given))
        assert "missing part 2 of 3" in message and parts[1].name in message
    assert "no such GGUF file" in one_line_error(str(tmp_path / "absent.gguf"))
    assert "no such GGUF file" in one_line_error(str(tmp_path / "gone-00001-of-00002.gguf"))


# -- listing --------------------------------------------------------------------------------------------------------

def test_list_local_ggufs_names_each_by_the_reference_that_opens_it(filled):
    found = {g.name: g for g in list_local_ggufs()}
    snapshot = filled["snapshot"]
    expected = {
        "ollama:llama3.2:latest": (filled["llama"], 64, "ollama"),
        "ollama:llama3.2:1b": (filled["llama1b"], 80, "ollama"),
        "ollama:someone/tiny:latest": (filled["someone"], 64, "ollama"),
        "ollama:hf.co/org/Some-GGUF:Q4_K_M": (filled["hfco"], 64, "ollama"),
        "org/Tiny-GGUF:Q4_K_M": (snapshot / "tiny-Q4_K_M.gguf", 100, "hf-cache"),
        "org/Tiny-GGUF:BF16": (snapshot / "tiny-BF16.gguf", 200, "hf-cache"),
        "org/Tiny-GGUF:F16": (snapshot / "tiny-F16.gguf", 200, "hf-cache"),
        "org/Tiny-GGUF:Q8_0": (snapshot / "Q8_0" / "tiny-Q8_0-00001-of-00002.gguf", 200, "hf-cache"),
        str(filled["lmstudio"]): (filled["lmstudio"], 70, "lmstudio"),
        str(filled["lmstudio_old"]): (filled["lmstudio_old"], 70, "lmstudio"),
    }
    assert found == {name: LocalGGUF(name, *row) for name, row in expected.items()}
    for g in found.values():            # every listed name opens the file listed
        assert resolve_gguf(g.name)[0] == g.path


def test_a_quant_label_shared_by_two_files_is_named_by_the_whole_file_name(stores):
    snapshot = hf_snapshot(stores["hf"], "org/Two-GGUF", {"a-Q4_K_M.gguf": gguf_bytes("a"),
                                                          "b-Q4_K_M.gguf": gguf_bytes("b")})
    names = sorted(g.name for g in list_local_ggufs())
    assert names == ["org/Two-GGUF:a-Q4_K_M", "org/Two-GGUF:b-Q4_K_M"]
    assert resolve_gguf("org/Two-GGUF:b-Q4_K_M") == [snapshot / "b-Q4_K_M.gguf"]


def test_list_survives_odd_stores(stores):
    assert list_local_ggufs() == []                     # nothing anywhere
    o, hf = stores["ollama"], stores["hf"]
    (o / "manifests" / "registry.ollama.ai" / "library" / "x").mkdir(parents=True)     # a model without tags
    (o / "manifests" / "stray-file").write_text("?")
    (hf / "models--org--broken" / "snapshots").mkdir(parents=True)                      # no snapshot
    (hf / "models--org--dangling" / "snapshots" / "c").mkdir(parents=True)
    (hf / "models--org--dangling" / "snapshots" / "c" / "d-Q4_0.gguf").symlink_to(hf / "nowhere")
    (stores["home"] / ".lmstudio-home-pointer").write_text(str(stores["tmp"] / "absent"))
    assert list_local_ggufs() == []
    assert [where for where, _ in gguf_stores()] == ["ollama", "hf-cache", "lmstudio", "lmstudio", "lmstudio"]


def test_lmstudio_home_pointer_is_followed(stores):
    elsewhere = stores["tmp"] / "lms-home"
    (elsewhere / "models" / "p" / "r").mkdir(parents=True)
    (elsewhere / "models" / "p" / "r" / "r-Q6_K.gguf").write_bytes(gguf_bytes("p"))
    (stores["home"] / ".lmstudio-home-pointer").write_text(f"{elsewhere}\n")
    assert [(g.where, g.path) for g in list_local_ggufs()] == [("lmstudio", elsewhere / "models/p/r/r-Q6_K.gguf")]


# -- the registry ---------------------------------------------------------------------------------------------------

def test_registry_resolves_each_kind_of_reference(filled, tmp_path):
    registry = Registry()
    snapshot = filled["snapshot"]
    for reference, path in [("ollama:llama3.2", filled["llama"]), ("ollama:someone/tiny:latest", filled["someone"]),
                            ("org/Tiny-GGUF:Q4_K_M", snapshot / "tiny-Q4_K_M.gguf"),
                            ("org/Tiny-GGUF:Q8_0", snapshot / "Q8_0" / "tiny-Q8_0-00001-of-00002.gguf"),
                            (str(filled["lmstudio"]), filled["lmstudio"]),
                            (str(filled["lmstudio_old"]).replace("00001", "00002"), filled["lmstudio_old"])]:
        entry = registry.resolve(reference)
        assert (entry.name, entry.path, entry.source, entry.table) == (reference, path, reference, {})
    with pytest.raises(UserError, match="ollama:nothere:latest"):
        registry.resolve("ollama:nothere")
    with pytest.raises(UserError, match=r"did you mean ollama:llama3\.2:1b\?"):    # Ollama's name without prefix
        registry.resolve("llama3.2:1b")
    with pytest.raises(UserError, match="unknown model 'nonsense'"):
        registry.resolve("nonsense")
    assert registry.resolve("org/plain-repo").path.as_posix() == "org/plain-repo"      # the old path, untouched


def test_models_toml_entries_may_name_gguf_references(filled, xdg_home):
    config = xdg_home / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "local.gguf").write_bytes(gguf_bytes("local"))
    (config / "models.toml").write_text('[models.llama]\nsource = "ollama:llama3.2:1b"\n\n'
                                        '[models.tinyq]\nsource = "hf:org/Tiny-GGUF:Q4_K_M"\n\n'
                                        '[models.local]\npath = "local.gguf"\n\n'
                                        '[models.gone]\nsource = "ollama:gone"\n')
    registry = Registry()
    assert registry.resolve("llama").path == filled["llama1b"] and registry.resolve("llama").name == "llama"
    assert registry.resolve("tinyq").path == filled["snapshot"] / "tiny-Q4_K_M.gguf"
    assert registry.resolve("local").path == config / "local.gguf"       # relative to models.toml
    with pytest.raises(ModelLoadError, match="ollama:gone:latest"):
        registry.resolve("gone")


# -- the CLI --------------------------------------------------------------------------------------------------------

def test_models_list_shows_the_ggufs_found(filled, pagedchat_cli):
    code, out, err = pagedchat_cli("models", "list")
    assert code == 0, err
    assert "demo" in out and "GGUF files found" in out
    assert out.index("demo") < out.index("GGUF files found")           # after the registry's entries
    lines = {line.split()[-1]: line.split()[:-1] for line in out.splitlines() if line.strip()}
    assert lines["ollama:llama3.2:latest"] == ["ollama", "64", "B"]
    assert lines["org/Tiny-GGUF:Q8_0"] == ["hf-cache", "200", "B"]
    assert lines[str(filled["lmstudio"])] == ["lmstudio", "70", "B"]
    for name in ("ollama:someone/tiny:latest", "ollama:hf.co/org/Some-GGUF:Q4_K_M", "org/Tiny-GGUF:Q4_K_M",
                 "org/Tiny-GGUF:F16", str(filled["lmstudio_old"])):
        assert name in lines
    code, out, err = pagedchat_cli("models", "list", "--json")
    listed = {g["name"]: g for g in json.loads(out)["ggufs"]}
    assert listed["org/Tiny-GGUF:Q8_0"] == {"name": "org/Tiny-GGUF:Q8_0", "size": 200, "where": "hf-cache",
                                            "path": str(filled["snapshot"] / "Q8_0/tiny-Q8_0-00001-of-00002.gguf")}
    assert len(listed) == 10


def test_models_list_says_where_it_looked_when_nothing_is_found(stores, pagedchat_cli):
    code, out, err = pagedchat_cli("models", "list")
    assert code == 0 and "no GGUF files found" in out and str(stores["ollama"]) in " ".join(out.split())


def test_models_show_a_gguf_reference(filled, pagedchat_cli):
    code, out, err = pagedchat_cli("models", "show", "ollama:llama3.2", "--json")
    assert code == 0, err
    settings = {s["key"]: (s["value"], s["from"]) for s in json.loads(out)["settings"]}
    assert settings["model"] == ("ollama:llama3.2", "command line (a GGUF file)")
    assert settings["path"] == (str(filled["llama"]), "ready (GGUF)")


@pytest.mark.parametrize("args", [("models", "show", "ollama:nothere"), ("run", "-m", "ollama:nothere", "hi"),
                                  ("models", "show", "org/Tiny-GGUF:Q5_K_S"), ("run", "-m", "missing.gguf", "hi")])
def test_a_bad_reference_is_one_line_and_exit_2(filled, pagedchat_cli, args):
    code, out, err = pagedchat_cli(*args)
    assert code == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("pagedchat: error: "), err
