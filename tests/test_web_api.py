"""The chat page's HTTP API without a browser: turns streamed as server-sent events, the tree's operations, the
REPL's session files both ways with exact token ids, two writers of one session, stop and disconnect, exports,
the pool per session, and the server's guards (Host, Origin, API key)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from chat_support import make_controller, make_engine
from serve_util import serving_page, slow_steps


def events(response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent event stream."""
    out, event = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[6:])))
    return out


def turn(client, name: str, path: str, **body) -> dict:
    """Run a turn; its `done` data (the test fails on an `error` event)."""
    with client.stream("POST", f"/api/sessions/{name}/{path}", json=body) as response:
        assert response.status_code == 200, response.read()
        got = events(response)
    assert got[0][0] == "start" and got[-1][0] == "done", got[-1]
    return got[-1][1]


@pytest.fixture
def page(model, tmp_path):
    with serving_page(model, tmp_path / "sessions") as (url, aengine):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, aengine, tmp_path / "sessions"


def greedy(client, name: str) -> int:
    view = client.get(f"/api/sessions/{name}").json()
    for key, value in (("temperature", "0"), ("max_tokens", "8")):
        view = client.post(f"/api/sessions/{name}/settings", json={"key": key, "value": value,
                                                                    "revision": view["revision"]}).json()
    return view["revision"]


def test_a_conversation_tree_through_the_api(page):
    client, _, sessions = page
    view = client.post("/api/sessions", json={"name": "tree"}).json()
    assert view["name"] == "tree" and view["nodes"] == [] and (sessions / "tree.json").is_file()
    rev = greedy(client, "tree")
    done = turn(client, "tree", "messages", text="hello world", revision=rev)
    s = done["session"]
    user, reply = done["user"], done["replies"][0]
    assert s["path"] == [user, reply] and s["head"] == reply and s["revision"] == rev + 1
    stats = done["stats"]
    assert stats["prompt_new"] + stats["prompt_cached"] == stats["prompt_tokens"] and stats["ttft_s"] > 0
    node = {n["id"]: n for n in s["nodes"]}[reply]
    assert node["role"] == "assistant" and node["stats"]["completion_tokens"] == node["tokens"] > 0
    assert "token_ids" not in node           # the page gets text; the JSON export has the ids

    # regenerate: a sibling of the reply; the old one stays
    s = turn(client, "tree", "regenerate", node_id=reply, revision=s["revision"])["session"]
    nodes = {n["id"]: n for n in s["nodes"]}
    assert nodes[user]["children"] == [reply, s["head"]] and nodes[s["head"]]["sibling_pos"] == 2
    # edit: a sibling branch of the user message
    done = turn(client, "tree", "edit", node_id=user, text="goodbye world", revision=s["revision"])
    s = done["session"]
    edited = done["user"]
    assert {n["id"]: n for n in s["nodes"]}[edited]["parent"] is None and s["roots"] == [user, edited]
    # fork 3 after a new message: three variants side by side, each a child of one user node
    done = turn(client, "tree", "messages", text="count to three", n=3, revision=s["revision"])
    s = done["session"]
    assert len(done["replies"]) == 3 and s["last_fork"] == done["replies"]
    variants = [n for n in s["nodes"] if n["id"] in done["replies"]]
    assert [v["variant"] for v in variants] == [1, 2, 3] and len({v["parent"] for v in variants}) == 1
    # continue from the second (switch without descending), then move back to the first branch's leaf
    s = client.post("/api/sessions/tree/switch", json={"node_id": done["replies"][1], "descend": False,
                                                        "revision": s["revision"]}).json()
    assert s["head"] == done["replies"][1]
    s = client.post("/api/sessions/tree/switch", json={"node_id": user, "revision": s["revision"]}).json()
    assert s["path"][0] == user and s["head"] == nodes[user]["children"][-1]
    # branch at a token: the reply's first token replaced
    reply_node = {n["id"]: n for n in s["nodes"]}[s["head"]]
    done = turn(client, "tree", "branch", node_id=reply_node["id"], index=0, token="Z", revision=s["revision"])
    new = {n["id"]: n for n in done["session"]["nodes"]}[done["replies"][0]]
    assert new["parent"] == user and new["text"].startswith("Z")
    # the system prompt: a new branch from the top
    s = client.post("/api/sessions/tree/system", json={"text": "Be brief.", "revision": done["session"]["revision"]}).json()
    assert s["system"] == "Be brief." and s["head"] is None and s["path"] == []

    saved = json.loads((sessions / "tree.json").read_text())
    assert saved["revision"] == s["revision"] and len(saved["nodes"]) == len(s["nodes"])
    listed = client.get("/api/sessions").json()["sessions"]
    assert [x["name"] for x in listed] == ["tree"] and listed[0]["opens_here"]


def test_sessions_are_the_repls_files_both_ways_with_exact_ids(model, tmp_path):
    """A session the REPL wrote continues in the browser with the ids the REPL itself would give, and the
    browser's turns continue in the REPL."""
    store = tmp_path / "sessions"
    engine = make_engine(model)
    repl = make_controller(engine, model, store)
    repl.new_session("shared")
    repl.send("hello world")
    shutil.copytree(store, tmp_path / "reference")
    reference = make_controller(engine, model, tmp_path / "reference")
    reference.open_session("shared")
    expected = reference.send("what is 2?").replies[0].token_ids

    with serving_page(model, store) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            view = client.get("/api/sessions/shared").json()
            assert [n["text"] for n in view["nodes"]][0] == "hello world"
            rev = greedy(client, "shared")
            done = turn(client, "shared", "messages", text="what is 2?", revision=rev)
    saved = json.loads((store / "shared.json").read_text())
    web_reply = {n["id"]: n for n in saved["nodes"]}[done["replies"][0]]
    assert web_reply["token_ids"] == expected

    again = make_controller(engine, model, store)
    again.open_session("shared")
    assert again.session.head == done["replies"][0]
    result = again.send("and 3?")
    assert result.save_error is None and not result.notes
    assert len(json.loads((store / "shared.json").read_text())["nodes"]) == 6


def test_two_writers_never_lose_a_turn(page, model):
    client, _, store = page
    view = client.post("/api/sessions", json={"name": "both"}).json()
    rev = greedy(client, "both")
    turn(client, "both", "messages", text="first", revision=rev)
    stale = client.get("/api/sessions/both").json()["revision"]

    repl = make_controller(make_engine(model), model, store)       # the same session in a REPL
    repl.open_session("both")
    repl.send("from the repl")
    r = client.post("/api/sessions/both/messages", json={"text": "from a stale page", "revision": stale})
    assert r.status_code == 409 and "changed in another window" in r.json()["error"]["message"]
    fresh = client.get("/api/sessions/both").json()
    assert "from the repl" in [n["text"] for n in fresh["nodes"]]
    done = turn(client, "both", "messages", text="from the page", revision=fresh["revision"])

    # the REPL is now behind the file: its next turn is added to the page's copy, not written over it
    result = repl.send("repl again")
    assert result.save_error is None and any("changed in another window" in n for n in result.notes)
    saved = json.loads((store / "both.json").read_text())
    texts = [n["text"] for n in saved["nodes"] if n["role"] == "user"]
    assert texts == ["first", "from the repl", "from the page", "repl again"]
    assert saved["head"] == result.replies[0].id and result.replies[0].parent == result.user.id
    by_id = {n["id"]: n for n in saved["nodes"]}
    assert by_id[result.user.id]["parent"] == by_id[done["user"]]["parent"]   # both answered the REPL's reply
    assert saved["revision"] == repl.session.revision


def test_stop_keeps_the_partial_reply_marked_interrupted(page):
    client, aengine, store = page
    client.post("/api/sessions", json={"name": "stop"})
    with slow_steps(aengine, 0.05):
        with client.stream("POST", "/api/sessions/stop/messages", json={"text": "tell me a long story"}) as response:
            got = []
            for line in response.iter_lines():
                if line.startswith("event: delta") and not got:
                    got.append(line)
                    assert client.post("/api/sessions/stop/stop").json() == {"stopping": True}
                if line.startswith("data: ") and '"session": {' in line:
                    done = json.loads(line[6:])
    assert done["interrupted"]
    reply = {n["id"]: n for n in done["session"]["nodes"]}[done["replies"][0]]
    assert reply["interrupted"] and reply["finish_reason"] == "interrupted"
    saved = json.loads((store / "stop.json").read_text())
    assert {n["id"]: n for n in saved["nodes"]}[reply["id"]]["interrupted"] is True


def test_a_client_that_goes_away_stops_its_turn_and_frees_the_session(page):
    client, aengine, store = page
    client.post("/api/sessions", json={"name": "gone"})
    with slow_steps(aengine, 0.05):
        with client.stream("POST", "/api/sessions/gone/messages", json={"text": "tell me a long story"}) as response:
            for line in response.iter_lines():
                if line.startswith("event: delta"):
                    break                  # leaving the block closes the connection mid-reply
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            saved = json.loads((store / "gone.json").read_text())
            if len(saved["nodes"]) == 2:
                break
            time.sleep(0.05)
    assert saved["nodes"][1]["interrupted"] is True
    free = lambda: client.post("/api/sessions/gone/switch", json={"node_id": 1}).status_code  # noqa: E731
    deadline = time.monotonic() + 30
    while (status := free()) == 409 and time.monotonic() < deadline:   # the turn's thread is finishing
        time.sleep(0.05)
    assert status == 200                    # the session is free again


def test_one_turn_at_a_time_per_session(page):
    client, aengine, _ = page
    client.post("/api/sessions", json={"name": "busy"})
    started = threading.Event()

    def long_turn():
        with client.stream("POST", "/api/sessions/busy/messages", json={"text": "a long story"}) as response:
            for line in response.iter_lines():
                if line.startswith("event: delta"):
                    started.set()
    with slow_steps(aengine, 0.05):
        thread = threading.Thread(target=long_turn)
        thread.start()
        try:
            assert started.wait(30)
            r = client.post("/api/sessions/busy/messages", json={"text": "meanwhile"})
            assert r.status_code == 409 and "still streaming" in r.json()["error"]["message"]
            client.post("/api/sessions/busy/stop")
        finally:
            thread.join(30)


def test_exports_and_the_pool_per_session(page):
    client, _, _ = page
    client.post("/api/sessions", json={"name": "ex"})
    rev = greedy(client, "ex")
    done = turn(client, "ex", "messages", text="hello world", n=2, revision=rev)
    md = client.get("/api/sessions/ex/export", params={"format": "markdown"})
    assert md.headers["content-disposition"] == 'attachment; filename="ex.md"'
    assert md.text.count("## branch") == 2 and "hello world" in md.text
    data = client.get("/api/sessions/ex/export", params={"format": "json"}).json()
    assert data["name"] == "ex" and all("token_ids" in n for n in data["nodes"]) and len(data["nodes"]) == 3
    assert client.get("/api/sessions/ex/export", params={"format": "pdf"}).status_code == 400
    pool = client.get("/api/pool").json()
    mine = pool["sessions"]["ex"]
    assert mine["pinned_branches"] == 2 and mine["blocks"] > 0 and mine["shared_blocks"] >= 1   # the prompt's blocks
    assert pool["used"] >= mine["blocks"] and done["stats"]["variants"] == 2
    assert client.get("/api/sessions/nope").status_code == 404


def test_host_and_origin_are_checked_for_every_request(page):
    client, _, _ = page
    for host in ("evil.example", "localhost.evil.example", "192.168.1.7"):
        r = client.get("/api/sessions", headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
        assert client.get("/v1/models", headers={"Host": host}).status_code == 421
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert client.get("/api/sessions", headers={"Host": host}).status_code == 200
    r = client.post("/api/sessions", json={}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"Origin": "null"})
    assert r.status_code == 403
    own = str(client.base_url).rstrip("/")
    assert client.post("/api/sessions", json={}, headers={"Origin": own}).status_code == 200
    assert client.get("/api/sessions", headers={"Origin": "https://evil.example"}).status_code == 200  # reads: CORS


def test_allowed_host_and_the_api_key(model, tmp_path):
    with serving_page(model, tmp_path / "s", api_key="sekrit", allowed_hosts=("chat.lan",)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/").status_code == 200          # the page itself holds nothing: it asks for the key
            assert client.get("/api/sessions").status_code == 401
            auth = {"Authorization": "Bearer sekrit"}
            assert client.get("/api/sessions", headers=auth).status_code == 200
            assert client.get("/api/sessions", headers={**auth, "Host": "chat.lan:8000"}).status_code == 200
            assert client.get("/api/info", headers=auth).json()["key_required"] is True


def test_the_page_and_its_files(page):
    client, _, _ = page
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    for selector in ('name="message"', 'data-action="send"', 'data-action="stop"', 'name="fork-n"',
                     'data-action="fork"', 'data-action="new-session"'):
        assert selector in r.text
    for name in ("app.js", "style.css", "markdown-it.min.js", "LICENSES.txt"):
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/../pyproject.toml").status_code == 404
    assert client.get("/static/index.html").status_code == 404


@pytest.mark.parametrize("web", [True, False])
def test_the_serve_command_shows_the_page_unless_no_web(model, tmp_path, web):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "pagedchat.cli", "serve", "-m", str(model), "--port", "0", "--kv-memory", "1MiB"]
    proc = subprocess.Popen(args + ([] if web else ["--no-web"]), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        base = first.split()[2].removesuffix("v1")
        if web:
            second = proc.stdout.readline()
            assert second.strip() == f"pagedchat serve: chat page at {base}"
        page = httpx.get(base, timeout=30)
        assert (page.status_code, "data-action=\"send\"" in page.text) == ((200, True) if web else (404, False))
        assert httpx.get(base + "api/info", timeout=30).status_code == (200 if web else 404)
        assert httpx.get(base + "v1/models", timeout=30).status_code == 200
        assert httpx.get(base + "v1/models", headers={"Host": "evil.example"}, timeout=30).status_code == 421
    finally:
        proc.terminate()
        proc.wait(30)


def test_ctrl_c_on_the_server_keeps_the_pages_reply_saved(model, tmp_path):
    """Stopping `pagedchat serve` while the page streams a reply ends the reply at the next step, kept and saved
    (interrupted), as Ctrl-C does in the REPL, and the page gets its `done`; the server exits cleanly."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedchat.cli", "serve", "-m", str(model), "--port", "0",
                             "--kv-memory", "4MiB"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        base = proc.stdout.readline().split()[2].removesuffix("v1")
        with httpx.Client(base_url=base, timeout=60) as client:
            view = client.post("/api/sessions", json={"name": "long"}).json()
            for key, value in (("max_tokens", "100000"), ("temperature", "0")):
                r = client.post("/api/sessions/long/settings", json={"key": key, "value": value,
                                                                      "revision": view["revision"]})
                assert r.status_code == 200, r.text
                view = r.json()
            got = []
            with client.stream("POST", "/api/sessions/long/messages", json={"text": "go on forever"}) as response:
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        got.append(line[7:])
                    if got == ["start", "delta"]:
                        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # No traceback through our code. (uvicorn's own shutdown sometimes logs its cancelled lifespan wait here,
    # seen once in two whole-suite runs: a known defect of that shutdown, left for its own fix.)
    ours = [line for line in stderr.splitlines() if 'File "' in line and "/pagedchat/" in line]
    assert proc.returncode == 0 and not ours, stderr
    assert got[-1] == "done"          # the page was told before the server went, not cut off
    saved = json.loads((tmp_path / "pagedchat" / "sessions" / "long.json").read_text())
    reply = saved["nodes"][-1]
    assert reply["role"] == "assistant" and reply["interrupted"] is True and reply["token_ids"]
