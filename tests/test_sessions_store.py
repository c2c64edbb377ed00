"""Sessions on disk: exact round trips, atomic private files, corrupt files set aside, failed writes harmless."""

import errno
import json
import os
import stat

import pytest

from chat_support import make_controller, make_engine
from pagedchat.chat.session import Session
from pagedchat.chat.store import SaveError, SessionStore, history_file
from pagedchat.chat.tree import Tree
from pagedchat.errors import UserError


@pytest.fixture
def ctl(model, tmp_path):
    c = make_controller(make_engine(model), model, tmp_path / "data" / "sessions", system="be brief")
    c.new_session("s")
    return c


def test_save_load_round_trips_token_ids_exactly(ctl):
    ctl.send("hello world")
    ctl.fork(3, "what is 17 + 25?")
    ctl.set_option("top_k", "5")
    ctl.session.tree.add(ctl.session.head, "user", "ünïcødé ✓ \x00", [0, 319, 7])  # odd text survives too
    ctl.save()
    saved = ctl.session
    loaded = ctl.store.load("s")
    assert loaded.to_dict() == saved.to_dict()
    for node in saved.tree.nodes.values():
        assert loaded.tree.get(node.id) == node  # role, text, exact token ids, flags, stats
    assert loaded.settings == {"top_k": 5} and loaded.last_fork == saved.last_fork
    assert sorted(n.variant for n in loaded.tree.nodes.values() if n.variant) == [1, 2, 3]
    data = json.loads(ctl.store.path("s").read_text())
    assert set(data) >= {"model", "settings", "created", "updated", "head", "nodes"}
    assert set(data["nodes"][-1]) >= {"id", "parent", "role", "text", "token_ids", "interrupted", "variant",
                                      "created", "stats"}


def test_files_are_private_and_written_atomically(ctl, monkeypatch):
    ctl.send("hello world")
    path = ctl.store.path("s")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["s.json"]  # no temp file left behind
    monkeypatch.setenv("XDG_DATA_HOME", str(path.parent.parent.parent / "xdg"))
    history = history_file()
    assert stat.S_IMODE(history.stat().st_mode) == 0o600


def test_a_failed_write_keeps_the_previous_file_and_says_so(ctl, monkeypatch):
    ctl.send("hello world")
    path = ctl.store.path("s")
    before = path.read_bytes()

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    result = ctl.send("what is 17 + 25?")  # the turn itself works; only the autosave fails
    assert result.replies and result.save_error
    assert "No space left on device" in result.save_error and "previous copy" in result.save_error
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["s.json"]
    with pytest.raises(SaveError):
        ctl.save()
    monkeypatch.undo()
    ctl.save()
    assert len(ctl.store.load("s").tree) == len(ctl.session.tree)


def test_corrupt_files_are_set_aside_and_the_others_still_listed(tmp_path):
    store = SessionStore(tmp_path / "sessions")
    good = Session("good", model="m")
    good.tree.add(None, "user", "hi", [1, 2, 3])
    store.save(good)
    store.save(Session("truncated", model="m"))
    raw = store.path("truncated").read_bytes()
    store.path("truncated").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "sessions" / "wrong.json").write_text(json.dumps({"version": 1, "nodes": [
        {"id": 1, "parent": 7, "role": "user", "text": "", "token_ids": []}]}))
    infos, warnings = store.list()
    assert [i.name for i in infos] == ["good"]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert any("truncated is corrupt" in w and "truncated.json.corrupt" in w for w in warnings)
    assert (tmp_path / "sessions" / "truncated.json.corrupt").read_bytes() == raw[: len(raw) // 2]
    assert (tmp_path / "sessions" / "wrong.json.corrupt").exists()
    assert store.load("good").tree.get(1).token_ids == [1, 2, 3]
    with pytest.raises(UserError, match="no session named 'truncated'"):
        store.load("truncated")


def test_names_are_checked_and_most_recent_is_found(tmp_path):
    store = SessionStore(tmp_path / "sessions")
    for bad in ("../x", "a/b", "", ".hidden", "x" * 101, "n.json"):
        with pytest.raises(UserError, match="invalid session name"):
            store.path(bad)
    store.save(Session("older"))
    store.save(Session("newer"))
    assert store.most_recent() == "newer"
    store.save(store.load("older"))
    assert store.most_recent() == "older"
    store.remove("older")
    assert store.names() == ["newer"]
    with pytest.raises(UserError, match="no session named"):
        store.remove("older")


def test_a_reloaded_session_continues_from_the_prefix_cache(ctl, model, tmp_path):
    first = ctl.send("hello world")
    ctl.send("what is 17 + 25?")
    history = len(ctl.session.tree.path_tokens(ctl.session.head))
    # Open it again in a second controller on the same engine (no pins are carried over): the pool's
    # prefix cache still serves every full block of the history.
    other = make_controller(ctl.engine, model, tmp_path / "data" / "sessions")
    for handle in ctl.session.handles.values():
        ctl.engine.release(handle)
    session, created = other.open_session("s")
    assert not created and session.tree.get(first.user.id).token_ids == first.user.token_ids
    result = other.send("and then?")
    assert result.stats["prompt_cached"] >= (history // 16) * 16 - 16 > 0


def test_opening_a_session_of_another_model_is_refused(ctl, tmp_path):
    ctl.send("hello world")
    data = json.loads(ctl.store.path("s").read_text())
    data["model"], data["model_path"] = "some-other-model", "/elsewhere"
    ctl.store.path("s").write_text(json.dumps(data))
    ctl.sessions.clear()
    with pytest.raises(UserError, match="recorded with model 'some-other-model'"):
        ctl.open_session("s")


def test_tree_order_and_descend():
    tree = Tree()
    a = tree.add(None, "user", "a", [1])
    b = tree.add(a.id, "assistant", "b", [2])
    c = tree.add(a.id, "assistant", "c", [3])
    assert [n.id for n in tree.siblings(b.id)] == [b.id, c.id]
    assert tree.descend(a.id) == c.id and tree.path_tokens(c.id) == [1, 3]
