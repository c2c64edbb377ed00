"""The native decode step's library (pagedchat/native/build.py): built once per machine and source, in the
background for the first process, checked before every load, and never in the way of the torch path: a failed
build, a cache that cannot be written, PAGEDCHAT_NATIVE=0 or a damaged cached file all leave a working run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.native import build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(build.load(wait=True) is None, reason="no native build here (no C compiler?)")


def engine_for(path, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, block_size=8, **kwargs),
                  show_progress=False)


def wait_for(target, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not (target.exists() and build._intact(target)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert target.exists() and build._intact(target), "the background build did not finish"


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """build.load() tried again from scratch, with an empty cache."""
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "fresh-cache"))
    return build


def test_switched_off_by_the_environment(model_dirs, fresh_build, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "0")
    engine = engine_for(model_dirs["llama"][0])
    assert engine.runner.native is None and fresh_build.status() == "native decode: off (PAGEDCHAT_NATIVE=0)"
    path, hf = model_dirs["llama"]
    assert_greedy_equal(engine.generate([[4, 5, 6]], GREEDY)[0].outputs[0].token_ids,
                        *reference(hf, [4, 5, 6], GREEDY.max_tokens))


def test_a_failed_build_leaves_the_torch_path(model_dirs, fresh_build, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert fresh_build.load(wait=True) is None
    assert fresh_build.status().startswith("native decode: off (build failed:")  # and it is not retried
    assert "to try again" in fresh_build.status()
    engine = engine_for(model_dirs["llama"][0])
    assert engine.runner.native is None
    path, hf = model_dirs["llama"]
    assert_greedy_equal(engine.generate([[4, 5, 6]], GREEDY)[0].outputs[0].token_ids,
                        *reference(hf, [4, 5, 6], GREEDY.max_tokens))


def test_a_cache_folder_that_cannot_be_written_leaves_the_torch_path(model_dirs, fresh_build, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(fresh_build.CACHE_ENV, str(blocker / "native"))
    for wait in (False, True):
        assert fresh_build.load(wait=wait) is None
        assert fresh_build.status().startswith("native decode: off (build failed:")
    engine = engine_for(model_dirs["llama"][0])
    assert engine.runner.native is None
    assert engine.generate([[4, 5, 6]], GREEDY)[0].outputs[0].token_ids


def test_the_first_engine_builds_in_the_background_and_switches_when_ready(model_dirs, fresh_build, monkeypatch):
    """No cached build: the engine starts at once on the torch path, one detached build runs, and a decode
    step after it finished binds the native step."""
    from pagedchat.engine.core import runner as runner_module

    monkeypatch.setattr(runner_module, "NATIVE_RETRY_S", 0.0)
    engine = engine_for(model_dirs["llama"][0])
    assert engine.runner.native is None and fresh_build.building()
    assert fresh_build.load() is None and fresh_build.building()  # a second look starts no second build
    wait_for(fresh_build.library_path(fresh_build._compiler()))
    path, hf = model_dirs["llama"]
    out = engine.generate([[4, 5, 6]], GREEDY)[0].outputs[0].token_ids
    assert engine.runner.native is not None
    assert_greedy_equal(out, *reference(hf, [4, 5, 6], GREEDY.max_tokens))


def test_a_build_is_cached_and_named_by_its_source(fresh_build, monkeypatch, tmp_path):
    lib = fresh_build.load(wait=True)
    compiler = fresh_build._compiler()
    target = fresh_build.library_path(compiler)
    assert lib is not None and target.exists() and target.parent == fresh_build.cache_dir()
    assert not list(target.parent.glob("*.tmp"))  # built under a private name, renamed into place
    changed = tmp_path / "decode.c"
    changed.write_text(fresh_build.SOURCE.read_text() + "\n/* another version */\n")
    monkeypatch.setattr(fresh_build, "SOURCE", changed)
    assert fresh_build.library_path(compiler) != target  # an edited source is never served a stale build


RUN_ONCE = """
import sys
from pagedchat.engine import Engine, EngineConfig, SamplingParams
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", num_blocks=64, block_size=8), show_progress=False)
out = engine.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("native" if engine.runner.native else "torch", out[0].outputs[0].token_ids)
"""


@pytest.fixture
def cached_copy(monkeypatch, tmp_path):
    """A fresh cache holding a copy of the session's build and its record (nothing compiled): the copy's path."""
    import shutil

    from pathlib import Path

    session = Path(build.load(wait=True)._name)  # the library this process loaded
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "fresh-cache"))
    target = build.library_path(build._compiler())
    target.parent.mkdir(parents=True)
    shutil.copy(session, target)
    shutil.copy(build._record(session), build._record(target))
    return target


def test_a_truncated_cached_library_is_rebuilt_and_the_run_goes_on(model_dirs, cached_copy):
    """The dynamic loader maps a truncated library and dies of SIGBUS on its first missing page: the check
    comes first. The run succeeds on the torch path with one warning line; the next process uses the rebuilt
    library."""
    target = cached_copy
    os.truncate(target, target.stat().st_size // 2)

    def run():
        done = subprocess.run([sys.executable, "-c", RUN_ONCE, str(model_dirs["llama"][0])], capture_output=True,
                              text=True, timeout=300, env=os.environ)
        assert done.returncode == 0, done.stderr
        return done.stdout.split(maxsplit=1), [line for line in done.stderr.splitlines() if line.strip()]

    (path, tokens), warnings = run()
    assert path == "torch" and len(warnings) == 1 and "does not match its build record" in warnings[0]
    wait_for(target)
    (path, again), warnings = run()
    assert path == "native" and warnings == [] and again == tokens


def test_a_library_that_differs_from_its_record_is_never_loaded(cached_copy, caplog, monkeypatch):
    """Same size with one byte changed, or no record at all (a build older than records): rebuilt before any
    load."""
    target = cached_copy
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    assert build.load(wait=True) is not None and build._intact(target)
    assert sum("does not match its build record" in r.message for r in caplog.records) == 1
    build._record(target).unlink()
    started = []
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "_start_background_build", lambda *args: started.append(args))
    assert build.load() is None and started and not target.exists()  # the torch path while it is rebuilt
