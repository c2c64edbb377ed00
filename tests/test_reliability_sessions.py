"""Bad input never loses data: corrupt session files are set aside and the rest stays usable, a failed write
leaves the previous file intact, Ctrl-C in prefill, decode or /fork leaves the pool consistent and the
session saved; and the security defaults (private files, no remote code, loopback server).

The store's own unit tests (tests/test_sessions_store.py) cover its API; these go through the controller,
the shell and the `pagedchat` command line as a user would, several sessions sharing one pool."""

import errno
import io
import json
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest
from rich.console import Console

from cli_util import invoke
from pagedchat.chat.controller import ChatController
from pagedchat.chat.shell import ChatShell, ChatUI
from pagedchat.chat.store import SessionStore
from pagedchat.errors import UserError
from pagedchat.settings import ModelOptions, SamplingOptions, load_engine


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data" / "pagedchat" / "sessions"


@pytest.fixture
def cli(capsys, monkeypatch, xdg):
    return lambda *args, stdin=None: invoke(list(args), stdin, capsys, monkeypatch)


@pytest.fixture
def ctl(model, xdg):
    engine, entry = load_engine(ModelOptions(str(model), device="cpu", kv_memory="1MiB"), show_progress=False)
    return ChatController(engine, entry, SessionStore(), SamplingOptions(temperature=0.0, max_tokens=6))


def shell_for(ctl):
    console = Console(file=io.StringIO(), width=160, color_system=None, highlight=False)
    return ChatShell(ctl, ChatUI(console)), console.file


def close(ctl, name):
    """Forget a resident session and release its pins (its file stays)."""
    session = ctl.sessions.pop(name)
    for handle in session.handles.values():
        ctl.engine.release(handle)
    if ctl.current is session:
        ctl.current = None


def pool_is_clean(engine, sessions):
    """Nothing running or queued; every used block belongs to a pinned branch head of these sessions."""
    engine.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    pins = [h for s in sessions for h in s.handles.values() if h.is_pinned]
    assert engine.pool.num_used == engine.blocks_held(pins)
    assert len(engine.scheduler.pins) == len(pins)


# -- corrupt and truncated session files ------------------------------------------------------------------------
CORRUPT = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "binary": lambda raw: b"\x00\xff\xfe" * 50,
    "not an object": lambda raw: b"[1, 2, 3]",
    "future version": lambda raw: raw.replace(b'"version":1', b'"version":99'),
    "token ids not ints": lambda raw: raw.replace(b'"token_ids":[', b'"token_ids":["x",', 1),
    "dangling parent": lambda raw: raw.replace(b'"parent":null', b'"parent":99', 1),
}


def make_sessions(ctl, *names):
    for name in names:
        ctl.new_session(name)
        ctl.send(f"hello from {name}")
    return {name: ctl.store.path(name) for name in names}


@pytest.mark.parametrize("damage", list(CORRUPT))
def test_corrupt_session_is_reported_set_aside_and_the_others_stay_usable(ctl, cli, damage):
    paths = make_sessions(ctl, "good", "bad", "other")
    raw = paths["bad"].read_bytes()
    paths["bad"].write_bytes(CORRUPT[damage](raw))
    broken = paths["bad"].read_bytes()

    code, out, err = cli("sessions", "list", "--json")
    assert code == 0 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "session bad is corrupt" in lines[0] and "bad.json.corrupt" in lines[0], err
    assert sorted(s["name"] for s in json.loads(out)["sessions"]) == ["good", "other"]
    aside = paths["bad"].with_name("bad.json.corrupt")
    assert aside.read_bytes() == broken and not paths["bad"].exists()   # kept for the user, byte for byte

    code, out, err = cli("run", "--session", "good", "--max-tokens", "3", "--temperature", "0", "again")
    assert code == 0 and not _errors(err), err     # (a note says the 3-token reply was cut)
    assert len(ctl.store.load("good").tree) == 4


def test_corrupt_session_opened_by_name(ctl, cli):
    paths = make_sessions(ctl, "a", "b")
    paths["b"].write_bytes(paths["b"].read_bytes()[:40])
    code, _, err = cli("chat", "--session", "b")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "session b is corrupt" in err and "b.json.corrupt" in err
    # a second corrupt copy of the same name does not overwrite the first one set aside
    make_sessions(ctl, "b2")
    ctl.store.path("b2").rename(paths["b"])
    paths["b"].write_bytes(b"{")
    code, _, err = cli("sessions", "show", "b")
    assert code == 2 and "b.json.corrupt.1" in err
    assert (paths["b"].parent / "b.json.corrupt").stat().st_size == 40


def test_continue_skips_a_corrupt_newest_session(ctl, cli):
    paths = make_sessions(ctl, "older", "newest")
    paths["newest"].write_text('{"version": 1, "nodes": [')
    code, out, err = cli("run", "-c", "--max-tokens", "3", "--temperature", "0", "--json", "more")
    assert code == 0, err
    assert json.loads(out)["session"]["name"] == "older"
    assert "newest" not in ctl.store.names()


def test_repl_open_of_a_corrupt_session_is_one_line_and_the_repl_goes_on(ctl):
    paths = make_sessions(ctl, "keep", "broken")
    paths["broken"].write_bytes(b"\x00")
    close(ctl, "broken")
    shell, screen = shell_for(ctl)
    shell.handle("/open broken")
    shell.handle("/sessions")
    text = screen.getvalue()
    assert "session broken is corrupt" in text and "Traceback" not in text
    assert "keep" in text
    shell.handle("/open keep")
    shell.handle("still here?")
    assert ctl.session.name == "keep" and len(ctl.store.load("keep").tree) == 4


# -- a write that fails never damages the previous file ------------------------------------------------------------
class FailingFile:
    """Writes half the data for real, then fails the way a full disk does."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        self.real.write(data[: len(data) // 2])
        self.real.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()
        return False


def disk_full(monkeypatch):
    import pagedchat.chat.store as store

    real_fdopen = os.fdopen
    monkeypatch.setattr(store.os, "fdopen", lambda fd, *a, **k: FailingFile(real_fdopen(fd, *a, **k)))


def read_only_folder(monkeypatch):
    """What a read-only folder does to the store (as root, chmod alone would not stop the write)."""
    import pagedchat.chat.store as store

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(store.tempfile, "mkstemp", refuse)


@pytest.mark.parametrize("fault,reason", [(disk_full, "No space left on device"),
                                          (read_only_folder, "Read-only file system")])
def test_failed_session_write_leaves_the_previous_file_intact(ctl, monkeypatch, fault, reason):
    make_sessions(ctl, "s")
    path = ctl.store.path("s")
    before = path.read_bytes()
    fault(monkeypatch)
    result = ctl.send("a second message")
    assert result.replies and reason in result.save_error and "previous copy on disk is unchanged" in result.save_error
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.json"]      # no temp file left behind
    monkeypatch.undo()
    ctl.save()                                                            # room again: nothing was lost
    assert len(ctl.store.load("s").tree) == 4


def test_failed_session_write_from_the_command_line(ctl, cli, monkeypatch):
    make_sessions(ctl, "s")
    before = ctl.store.path("s").read_bytes()
    disk_full(monkeypatch)
    code, out, err = cli("run", "--session", "s", "--max-tokens", "3", "--temperature", "0", "more")
    assert code == 1 and out.strip(), (code, out, err)                   # the reply was still shown
    # the full disk also stops the KV disk tier, with its own one warning line (tests/test_kv_tiers.py)
    err = "\n".join(line for line in _errors(err).splitlines() if "warning: KV disk cache" not in line)
    assert len(err.strip().splitlines()) == 1 and "No space left on device" in err and "Traceback" not in err
    assert ctl.store.path("s").read_bytes() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_really_read_only_folder(ctl):
    make_sessions(ctl, "s")
    path = ctl.store.path("s")
    before = path.read_bytes()
    path.parent.chmod(0o500)
    try:
        result = ctl.send("more")
        assert result.save_error and path.read_bytes() == before
    finally:
        path.parent.chmod(0o700)


# -- Ctrl-C during prefill, decode and /fork -------------------------------------------------------------------
def interrupt_forward_pass(engine, at_call: int, how: str):
    """Ctrl-C arriving during the at_call-th forward pass: as KeyboardInterrupt out of the model (plain
    Python), or as a real SIGINT (the REPL's handler turns it into a stop request)."""
    real_run, calls = engine.runner.run, []

    def run(batch):
        calls.append(sum(n for _, n in batch.items))
        if len(calls) == at_call:
            if how == "exception":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGINT)
        return real_run(batch)

    engine.runner.run = run
    return calls, real_run


@pytest.mark.parametrize("how", ["exception", "signal"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "fork-prefill", "fork-decode"])
def test_ctrl_c_leaves_the_pool_consistent_and_the_session_saved(ctl, phase, how):
    make_sessions(ctl, "other")                       # another session resident in the same pool, with a pin
    ctl.new_session("main")
    ctl.send("first message")
    ctl.cli.max_tokens = 40
    calls, real_run = interrupt_forward_pass(ctl.engine, 1 if phase.endswith("prefill") else 4, how)
    shell, screen = shell_for(ctl)
    command = "/fork 3 tell me more" if phase.startswith("fork") else "tell me more"
    shell.handle(command)
    text = screen.getvalue()
    assert "Traceback" not in text and "internal error" not in text, text
    assert "interrupted" in text, text
    if phase == "prefill":
        assert calls[0] > 10                          # the interrupted pass was the prompt's prefill

    pool_is_clean(ctl.engine, ctl.sessions.values())
    saved = ctl.store.load("main")
    replies = [n for n in saved.tree.nodes.values() if n.role == "assistant"]
    assert len(replies) >= 2 and replies[-1].interrupted
    if phase == "fork-decode":
        assert sum(1 for n in replies if n.variant) == 3 and all(len(n.token_ids) < 40 for n in replies[1:])
    assert saved.head == ctl.session.head
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    ctl.engine.runner.run = real_run
    ctl.cli.max_tokens = 4
    shell.handle("and now?")                          # the conversation goes on from the partial reply
    assert len(ctl.store.load("main").tree) == len(saved.tree) + 2
    ctl.open_session("other")
    shell.handle("and the other one?")
    pool_is_clean(ctl.engine, ctl.sessions.values())


def _spawn(args, env):
    return subprocess.Popen([sys.executable, "-m", "pagedchat.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _interrupt_after_first_output(proc, timeout=120):
    """SIGINT once the reply starts streaming; (stdout, stderr, exit code), all bounded by timeouts."""
    first = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout)
    assert first and first[0], "no output before the timeout"
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the process did not stop within 60 s of Ctrl-C")
    return first[0] + out, err.decode(), proc.returncode


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "PYTHONUNBUFFERED": "1"}


# the tiny llama model answers "hello" greedily with 480 tokens (no EOS): seconds of decoding to interrupt
LONG = ["--raw", "--temperature", "0", "--max-tokens", "480", "--kv-memory", "1MiB"]


def test_run_ctrl_c_exits_130_with_one_line(model, env):
    proc = _spawn(["run", "-m", str(model), *LONG, "hello"], env)
    out, err, code = _interrupt_after_first_output(proc)
    assert code == 130, (code, err)
    assert err.strip().splitlines() == ["pagedchat: interrupted"], err


def test_run_session_ctrl_c_saves_the_partial_reply(model, env, tmp_path):
    proc = _spawn(["run", "-m", str(model), "--session", "talk", "--temperature", "0", "--max-tokens", "480",
                   "--kv-memory", "1MiB", "hello"], env)
    out, err, code = _interrupt_after_first_output(proc)
    assert code == 130, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "saved in session talk" in lines[0], err
    saved = json.loads((tmp_path / "data" / "pagedchat" / "sessions" / "talk.json").read_text())
    reply = saved["nodes"][-1]
    assert reply["role"] == "assistant" and reply["interrupted"] and 0 < len(reply["token_ids"]) < 480


# -- security defaults -----------------------------------------------------------------------------------------
def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_session_and_history_files_are_private_whatever_the_umask(ctl, xdg):
    from pagedchat.chat.store import history_file

    xdg.parent.mkdir(parents=True, mode=0o755)          # folders that already exist, too open
    os.chmod(xdg.parent, 0o755)
    xdg.mkdir(mode=0o755)
    os.chmod(xdg, 0o755)
    old = os.umask(0)
    try:
        make_sessions(ctl, "s")
        history = history_file()
    finally:
        os.umask(old)
    assert mode(ctl.store.path("s")) == 0o600
    assert mode(xdg) == 0o700 and mode(xdg.parent) == 0o700
    assert mode(history) == 0o600 and history.parent == xdg.parent


def test_trust_remote_code_only_from_the_model_entry(model, xdg, tmp_path, monkeypatch):
    import pagedchat.engine

    seen = []

    class Engine:
        def __init__(self, config, show_progress=True):
            seen.append(config.trust_remote_code)
            self.tokenizer = None

    monkeypatch.setattr(pagedchat.engine, "Engine", Engine)
    toml = tmp_path / "config" / "pagedchat" / "models.toml"
    toml.parent.mkdir(parents=True)
    entries = f'[models.plain]\nsource = "{model}"\n\n[models.remote]\nsource = "{model}"\ntrust_remote_code = true\n'
    toml.write_text(entries)
    for name in ("plain", "remote", str(model)):
        load_engine(ModelOptions(name, device="cpu"))
    assert seen == [False, True, False]
    # a blanket [defaults] trust_remote_code would let every model folder run code: refused, with its line
    toml.write_text("[defaults]\nmodel = \"plain\"\ntrust_remote_code = true\n\n" + entries)
    with pytest.raises(UserError, match=r"models.toml:3: \[defaults\] trust_remote_code is allowed only in a model"):
        load_engine(ModelOptions("plain", device="cpu"))
    assert seen == [False, True, False]


def test_the_loader_passes_trust_remote_code_false_by_default(model, monkeypatch):
    import transformers

    from pagedchat.model import loader

    calls = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            calls.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    loader.load_model(str(model), device="cpu", show_progress=False)
    assert not any(trust for _, trust in calls), calls
    # a folder it cannot read itself (another family, a tokenizer it cannot reproduce) goes to transformers:
    monkeypatch.setattr(loader, "read_config", lambda path: None)
    monkeypatch.setattr(loader, "load_fast_tokenizer", lambda model_dir: None)
    loader.load_model(str(model), device="cpu", show_progress=False)
    assert ("AutoConfig", False) in calls and ("AutoTokenizer", False) in calls
    assert not any(trust for _, trust in calls), calls


def test_server_binds_loopback_unless_told_otherwise():
    import typer

    from pagedchat.cli import app
    from pagedchat.serve.server import bind_socket, is_loopback

    serve = typer.main.get_command(app).commands["serve"]
    host = next(p for p in serve.params if p.name == "host")
    assert host.default == "127.0.0.1" and is_loopback(host.default)
    sock = bind_socket(host.default, 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_fork_whose_variant_outgrows_the_pool_fails_alone_and_leaves_no_stray_pin(model, xdg):
    engine, entry = load_engine(ModelOptions(str(model), device="cpu", kv_memory="48KiB"), show_progress=False)
    assert engine.pool.num_blocks == 6                                    # 96 tokens in all
    ctl = ChatController(engine, entry, SessionStore(), SamplingOptions(temperature=0.0, max_tokens=200))
    ctl.new_session("s")
    real_run = engine.runner.run

    def variant_3_stops_late(batch):
        """Variant 3 ends after 30 tokens, once its siblings were preempted; the others never end."""
        logits, samplers = real_run(batch)
        if logits is not None:
            logits = logits.clone()
            for row, seq in enumerate(samplers):
                stop = seq.index == 2 and seq.num_output_tokens >= 30
                for eos in engine.eos_token_ids:
                    logits[row, eos] = 1e4 if stop else -1e4
        return logits, samplers

    engine.runner.run = variant_3_stops_late
    shell, screen = shell_for(ctl)
    shell.handle("/fork 3 " + "hello there " * 5)
    text = screen.getvalue()
    assert "more KV memory than the whole pool" in text and "Traceback" not in text, text
    assert len(ctl.session.tree) == 0                                     # nothing half-recorded
    pool_is_clean(engine, [ctl.session])
    assert engine.pool.num_used == 0 and not engine.scheduler.pins       # the variant that ended is not pinned
    engine.runner.run = real_run
    ctl.cli.max_tokens = 4
    shell.handle("a short one")
    assert len(ctl.session.tree) == 2


def test_a_long_chat_over_many_sessions_never_leaks_blocks(model, xdg):
    """Sixty random REPL actions over three sessions sharing a small pool (pins get evicted): after each one,
    every used block belongs to a pinned branch head some session still knows; closing every session frees
    the whole pool."""
    import random

    engine, entry = load_engine(ModelOptions(str(model), device="cpu", kv_memory="256KiB"), show_progress=False)
    ctl = ChatController(engine, entry, SessionStore(), SamplingOptions(temperature=0.0, max_tokens=5))
    shell, screen = shell_for(ctl)
    rng = random.Random(7)
    drops = {"pressure": 0}
    real_make_room, real_evict = engine.scheduler._make_room, engine.scheduler.evict_pin

    def make_room(*args, **kwargs):  # pins dropped while making room, not released by the controller
        engine.scheduler.evict_pin = lambda seq: (drops.__setitem__("pressure", drops["pressure"] + 1),
                                                  real_evict(seq))
        try:
            return real_make_room(*args, **kwargs)
        finally:
            engine.scheduler.evict_pin = real_evict

    engine.scheduler._make_room = make_room
    names = ["a", "b", "c"]
    for name in names:
        shell.handle(f"/new {name}")
    for _ in range(60):
        session = ctl.session
        nodes = list(session.tree.nodes.values())
        users = [n.id for n in nodes if n.role == "user"]
        action = rng.choice(["send", "send", "regen", "fork", "switch", "edit", "open", "pick"])
        if action == "send" or not nodes:
            shell.handle(f"message {rng.randrange(1000)} " * rng.randint(1, 6))
        elif action == "regen":
            shell.handle("/regen")
        elif action == "fork":
            shell.handle(f"/fork {rng.randint(2, 4)}")
        elif action == "switch":
            shell.handle(f"/switch {rng.choice(nodes).id}")
        elif action == "edit" and users:
            shell.handle(f"/edit {rng.choice(users)} edited {rng.randrange(100)}")
        elif action == "pick":
            shell.handle(f"/pick {rng.randint(1, 3)}")
        else:
            shell.handle(f"/open {rng.choice(names)}")
        pool_is_clean(engine, ctl.sessions.values())
    text = screen.getvalue()
    assert "Traceback" not in text and "internal error" not in text, text
    assert sum(len(s.tree) for s in ctl.sessions.values()) > 60
    assert drops["pressure"] > 0, "the pool never ran short: pins were never evicted"
    for name in names:
        close(ctl, name)
    engine.check_invariants()
    assert engine.pool.num_used == 0 and not engine.scheduler.pins


def _errors(stderr: str) -> str:
    """stderr without the notes about a reply (cut at the length limit, ...): what went wrong, if anything."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("pagedchat: note: "))
