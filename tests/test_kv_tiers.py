"""The RAM and disk KV tiers below the pool: blocks come back token-identical, and no bad cache file (corrupt,
truncated, foreign, written concurrently) nor an unwritable folder ever changes a token or fails a turn."""

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.kv import disk as kv_disk
from pagedchat.engine.kv.block_pool import chain_hash
from pagedchat.engine.kv.disk import DiskTier, block_files, folder_usage
from pagedchat.engine.kv.fingerprint import kv_cache_root
from pagedchat.model.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = [5 + (i * 7) % 300 for i in range(150)]   # 9 full blocks of 16, and 6 tokens
FULL_BLOCKS = 9


@pytest.fixture(scope="module")
def loaded(model):
    return load_model(str(model), "cpu", "float32", show_progress=False)


@pytest.fixture
def kv_dir(tmp_path):
    return tmp_path / "kv"


@pytest.fixture
def make_engine(loaded, kv_dir):
    def make(num_blocks=64, **tiers):
        config = EngineConfig(model=str(loaded.path), device="cpu", num_blocks=num_blocks, kv_dir=str(kv_dir),
                              **tiers)
        return Engine(config, loaded=loaded, show_progress=False)
    return make


@pytest.fixture
def reference(make_engine):
    """Greedy tokens of a never-restarted engine with no tiers."""
    def tokens(prompt):
        return make_engine().generate([prompt], GREEDY)[0].outputs[0].token_ids
    return tokens


def _save_session(engine, prompt):
    """One turn kept pinned, written through (a session save), then the process ends."""
    out = engine.generate([prompt], GREEDY, keep=True)[0]
    engine.persist([out.outputs[0].handle])
    engine.close()
    return out


def test_reopened_prompt_loads_from_disk_and_replies_identically(make_engine, reference, kv_dir):
    _save_session(make_engine(kv_disk="8MiB"), PROMPT)
    follow_up = PROMPT + [9, 10, 11]
    out = make_engine(kv_disk="8MiB").generate([follow_up], GREEDY)[0]
    assert out.disk_hit_tokens == out.prefix_hit_tokens == FULL_BLOCKS * 16
    assert out.outputs[0].token_ids == reference(follow_up)


def test_close_writes_the_pool_through_without_a_session(make_engine, kv_dir):
    """A server restart: nothing was pinned or saved, yet the cached prompt blocks survive the close."""
    engine = make_engine(kv_disk="8MiB")
    engine.generate([PROMPT], GREEDY)
    engine.close()
    out = make_engine(kv_disk="8MiB").generate([PROMPT], GREEDY)[0]
    assert out.disk_hit_tokens == FULL_BLOCKS * 16


def test_ram_tier_keeps_blocks_the_pool_evicted(make_engine, reference):
    engine = make_engine(num_blocks=16, kv_ram="4MiB")
    engine.generate([PROMPT[:100]], GREEDY)
    engine.generate([[7 + i % 50 for i in range(220)]], GREEDY)   # 14 blocks: evicts the first prompt's
    again = PROMPT[:100] + [3]
    out = engine.generate([again], GREEDY)[0]
    assert out.ram_hit_tokens > 0 and engine.pool_stats().ram_hit_tokens == out.ram_hit_tokens
    assert out.outputs[0].token_ids == reference(again)
    engine.tiers.ram.check_invariants()


def _flip_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


FAULTS = {
    "corrupt payload": _flip_payload_byte,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage header": lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:]),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_block_files_are_misses_and_removed(make_engine, reference, kv_dir, fault):
    _save_session(make_engine(kv_disk="8MiB"), PROMPT)
    key = chain_hash(chain_hash(chain_hash(None, tuple(PROMPT[:16])), tuple(PROMPT[16:32])), tuple(PROMPT[32:48]))
    (path,) = [p for p in block_files(next(kv_dir.iterdir())) if p.name.startswith(key.hex())]
    FAULTS[fault](path)
    out = make_engine(kv_disk="8MiB").generate([PROMPT], GREEDY)[0]
    assert out.disk_hit_tokens == 2 * 16                  # the chain stops at the bad third block
    assert out.outputs[0].token_ids == reference(PROMPT)
    assert not path.exists()


def test_damaged_bookkeeping_files_change_nothing(make_engine, reference, kv_dir):
    """meta.json, stats.json and the weight-digest cache are damaged (another process died mid-way, a user
    edited them): the blocks still load, the tokens are the same, and meta.json is written again."""
    _save_session(make_engine(kv_disk="8MiB"), PROMPT)
    (folder,) = [p for p in kv_dir.iterdir() if p.is_dir()]
    for path in (folder / "meta.json", folder / "stats.json", kv_dir / "weight-digests.json"):
        path.write_bytes(b"\x00{not json")
    engine = make_engine(kv_disk="8MiB")
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.disk_hit_tokens == FULL_BLOCKS * 16 and out.outputs[0].token_ids == reference(PROMPT)
    engine.close()
    assert kv_disk.read_meta(folder)["block_size"] == 16 and kv_disk.read_stats(folder)["hits"] == FULL_BLOCKS


def _tier(folder, fingerprint="fp", capacity=1 << 20):
    return DiskTier(folder, fingerprint, capacity, (2, 3), torch.float32, warn=lambda line: None)


def test_foreign_files_are_misses_and_removed(tmp_path):
    tokens_a, tokens_b = (1, 2, 3), (4, 5, 6)
    key_a, key_b = chain_hash(None, tokens_a), chain_hash(None, tokens_b)
    payload = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    mine = _tier(tmp_path / "fp")
    mine.put(key_a, tokens_a, payload)
    assert torch.equal(mine.get(key_a, tokens_a), payload)
    # another fingerprint's tier finds the file at the same path: not its block
    other = _tier(tmp_path / "fp", fingerprint="other")
    assert other.get(key_a, tokens_a) is None and not mine.contains(key_a)
    # a block file copied under another key's name
    mine.put(key_a, tokens_a, payload)
    mine.path(key_b).parent.mkdir(parents=True, exist_ok=True)
    mine.path(key_b).write_bytes(mine.path(key_a).read_bytes())
    assert mine.get(key_b, tokens_b) is None and not mine.contains(key_b)
    # same key, other shape (a different model layout)
    mine.put(key_b, tokens_b, torch.zeros(3, 2))
    assert mine.get(key_b, tokens_b) is None


def test_files_are_private(make_engine, kv_dir):
    _save_session(make_engine(kv_disk="8MiB"), PROMPT)
    cache_root = kv_dir.parent
    for path in [kv_dir, *kv_dir.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path.relative_to(cache_root)}: {oct(mode)}"


def test_unwritable_folder_warns_once_and_the_turn_succeeds(loaded, tmp_path, capfd, reference):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = EngineConfig(model=str(loaded.path), device="cpu", num_blocks=64, kv_disk="8MiB",
                          kv_dir=str(blocker / "kv"))
    engine = Engine(config, loaded=loaded, show_progress=False)
    out = _save_session(engine, PROMPT)
    assert out.outputs[0].token_ids == reference(PROMPT)
    assert capfd.readouterr().err.count("cannot be written") == 1


def test_full_disk_warns_once_and_the_turn_succeeds(make_engine, reference, monkeypatch, capfd):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    engine = make_engine(kv_disk="8MiB")
    monkeypatch.setattr(kv_disk, "atomic_write", full)
    out = _save_session(engine, PROMPT)
    assert out.outputs[0].token_ids == reference(PROMPT)
    err = capfd.readouterr().err
    assert err.count("cannot be written") == 1 and "No space left" in err


def test_folder_stays_under_its_budget_least_recently_used_first(tmp_path):
    payload = torch.ones(2, 3)
    tier = _tier(tmp_path / "fp")
    keys = [chain_hash(None, (i,)) for i in range(6)]
    tier.put(keys[0], (0,), payload)
    size = tier.path(keys[0]).stat().st_size
    tier = _tier(tmp_path / "fp", capacity=5 * size)
    for i, key in enumerate(keys[1:4], 1):
        tier.put(key, (i,), payload)
    for i, key in enumerate(keys[:4]):          # oldest first, then block 0 is read again
        os.utime(tier.path(key), (1000 + i, 1000 + i))
    assert tier.get(keys[0], (0,)) is not None
    for i, key in enumerate(keys[4:], 4):       # 6 blocks > 5: trimmed to 4, the two oldest go
        tier.put(key, (i,), payload)
    assert folder_usage(tmp_path / "fp").bytes <= 5 * size
    assert [tier.contains(k) for k in keys] == [True, False, False, True, True, True]


_WRITER = """
import sys, torch
from pagedchat.engine.kv.block_pool import chain_hash
from pagedchat.engine.kv.disk import DiskTier
tier = DiskTier(sys.argv[1], "fp", 1 << 30, (64, 64), torch.float32, warn=print)
for round in range(3):
    for i in range(40):
        tier.put(chain_hash(None, (i,)), (i,), torch.full((64, 64), float(i)))
        tier.path(chain_hash(None, (i,))).unlink(missing_ok=True)  # so the next round writes it again
"""


def test_concurrent_writers_and_a_reader_never_see_a_wrong_block(tmp_path):
    folder = tmp_path / "fp"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(folder)]) for _ in range(2)]
    reader = DiskTier(folder, "fp", 1 << 30, (64, 64), torch.float32, warn=print)
    seen = 0
    while any(w.poll() is None for w in writers):
        for i in range(40):
            got = reader.get(chain_hash(None, (i,)), (i,))
            if got is not None:
                assert torch.equal(got, torch.full((64, 64), float(i)))
                seen += 1
    assert all(w.wait() == 0 for w in writers)
    assert not list(folder.rglob("*.tmp")), "a writer left a temp file behind"


def test_run_session_reopened_in_a_new_process_hits_disk(pagedchat_cli, model):
    """The outside check's flow: `run --session` in one process, then `--json` in the next, against the
    same two turns with --kv-disk 0; then with every cache file corrupted."""
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)

    def two_turns(name, *flags):
        code, _, err = pagedchat_cli("run", "-m", str(model), "--session", name, "-t", "0", "--max-tokens", "6",
                                     *flags, long_prompt)
        assert code == 0, err
        code, out, err = pagedchat_cli("run", "-m", str(model), "--session", name, "-t", "0", "--max-tokens", "6",
                                       "--json", *flags, "and once more")
        assert code == 0, err
        return json.loads(out)

    cached = two_turns("cached")
    plain = two_turns("plain", "--kv-disk", "0")
    assert cached["kv"]["disk_hit_tokens"] > 100 and plain["kv"]["disk_hit_tokens"] == 0
    assert cached["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    code, out, _ = pagedchat_cli("cache", "stats", "--json")
    (row,) = json.loads(out)["fingerprints"]
    assert row["blocks"] > 0 and row["hits"] > 0
    (folder,) = [p for p in kv_cache_root().iterdir() if p.is_dir()]
    for path in block_files(folder):
        _flip_payload_byte(path)
    corrupted = two_turns("corrupted")
    assert corrupted["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    code, out, _ = pagedchat_cli("cache", "clear", "--model", str(model))
    assert code == 0 and "removed" in out
    assert json.loads(pagedchat_cli("cache", "stats", "--json")[1])["fingerprints"] == []


def test_serve_restart_keeps_the_cached_system_prompt(model):
    """The first request after a restart reports cached_tokens > 0: the closing server wrote its cached
    prompt blocks to the disk tier, and the new one loads them. A server that is killed instead (never
    closes) saved them too: it checkpoints its new cached blocks to disk whenever it goes idle."""
    import time

    import httpx

    from pagedchat.serve import AsyncEngine, create_app
    from pagedchat.serve.server import settings_for
    from pagedchat.settings import ModelOptions, load_engine
    from serve_util import serving

    system = " ".join(["you are a helpful assistant who answers briefly"] * 6)

    @contextlib.contextmanager
    def server():
        engine, entry = load_engine(ModelOptions(model=str(model), device="cpu", kv_memory="1MiB"),
                                    show_progress=False)
        with serving(create_app(AsyncEngine(engine), settings_for(entry, None, "tiny"))) as url:
            yield url

    def cached_tokens(url, user: str) -> int:
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        r = httpx.post(url + "/chat/completions", json=body, timeout=60)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def disk_blocks() -> int:
        return sum(folder_usage(p).blocks for p in kv_cache_root().iterdir() if p.is_dir())

    with server() as first:
        assert cached_tokens(first, "hello") == 0
        deadline = time.monotonic() + 60   # the idle checkpoint's writes run on the writer thread
        while disk_blocks() < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        with server() as second:           # the first one is still up: it never closed (as if killed)
            assert cached_tokens(second, "what is 17 + 25?") > 0
    with server() as third:                # both closed: a plain restart
        assert cached_tokens(third, "and 6 * 7?") > 0


def _bench(*args: str) -> dict:
    from typer.testing import CliRunner

    from pagedchat.cli import app

    result = CliRunner().invoke(app, ["bench", *args, "--json"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads(result.stdout)


REOPEN = ("--random", "llama", "--random-size", "tiny", "--history", "96", "--message-tokens", "8",
          "--reply-tokens", "4", "--repeats", "1", "--device", "cpu")


def _reopened_from_disk(r: dict, same: str) -> None:
    (row,) = r["rows"]
    assert row["history"] == 96 and row["disk_hit_tokens"] >= 80, r   # the history's full blocks
    assert row[same] is True and row["ttft_disk_s"] > 0 and row["ttft_reprefill_s"] > 0, r


def test_chat_reopen_loads_the_history_from_disk_in_a_fresh_engine():
    _reopened_from_disk(_bench("chat", "--reopen", *REOPEN), "identical_to_never_restarted")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDCHAT_SLOW") != "1", reason="slow: set PAGEDCHAT_SLOW=1")
def test_chat_reopen_in_new_processes():
    """Six `pagedchat run` starts: slow on a small machine (test_run_session_reopened_in_a_new_process_hits_disk covers the path)."""
    _reopened_from_disk(_bench("chat", "--reopen", "--processes", *REOPEN), "identical_to_reprefill")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGEDCHAT_SLOW") != "1", reason="slow: set PAGEDCHAT_SLOW=1")
def test_bench_serve_restart():
    """Four `pagedchat serve` starts (test_serve_restart_keeps_the_cached_system_prompt covers the path)."""
    (row,) = _bench("chat", "--serve-restart", "--random", "llama", "--random-size", "tiny", "--history", "96",
                    "--repeats", "1")["rows"]
    assert row["cached_tokens_disk"] >= 80 and row["cached_tokens_plain"] == 0 and row["identical"], row


def test_fingerprint_separates_models_and_settings(model, tmp_path, monkeypatch):
    from pagedchat.engine.kv import fingerprint as fp
    from pagedchat.model.loader import weight_files

    files = weight_files(model)
    base = fp.engine_fingerprint(model, files, torch.float32, 16, "cpu", tmp_path)[0]
    assert base == fp.engine_fingerprint(model, files, torch.float32, 16, "cpu", tmp_path)[0]
    others = {fp.engine_fingerprint(model, files, torch.float32, 32, "cpu", tmp_path)[0],
              fp.engine_fingerprint(model, files, torch.bfloat16, 16, "cpu", tmp_path)[0],
              fp.engine_fingerprint(model, files, torch.float32, 16, "cuda", tmp_path)[0]}
    assert base not in others and len(others) == 3
    # the weight digest is cached per (size, mtime): unchanged files are not read again
    monkeypatch.setattr(fp, "file_digest", lambda path: pytest.fail("re-hashed an unchanged file"))
    assert fp.engine_fingerprint(model, files, torch.float32, 16, "cpu", tmp_path)[0] == base
    monkeypatch.undo()
    # other weights (a copy of the model with one weight byte changed): another fingerprint
    other = tmp_path / "other-model"
    other.mkdir()
    for f in model.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    data = bytearray((other / files[0].name).read_bytes())
    data[-1] ^= 0x01
    (other / files[0].name).write_bytes(bytes(data))
    assert fp.engine_fingerprint(other, weight_files(other), torch.float32, 16, "cpu", tmp_path)[0] != base


def test_blocks_used_within_one_clock_tick_trim_in_the_order_they_were_used(tmp_path, monkeypatch):
    """Recency stamps are strictly increasing within a process: with a clock that does not move, the trim
    order is still the use order (ties made which block survives depend on timing)."""
    import pagedchat.engine.kv.disk as kv_disk

    monkeypatch.setattr(kv_disk.time, "time_ns", lambda: 10**18)
    tier = _tier(tmp_path / "fp")
    keys = [chain_hash(None, (i,)) for i in range(4)]
    for i, key in enumerate(keys):
        tier.put(key, (i,), torch.ones(2, 3))
    assert tier.get(keys[0], (0,)) is not None
    stamps = [tier.path(k).stat().st_mtime_ns for k in keys[1:] + keys[:1]]
    assert stamps == sorted(stamps) and len(set(stamps)) == 4
