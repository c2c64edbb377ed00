"""`chat` / `run --server URL`: a real `pagedchat serve` subprocess on the tiny model generates, and the
results must be the local engine's: the same tokens at temperature 0, the same session files (started
locally, continued remotely and back), /fork 3 as three siblings, the server's cached_tokens on turn 2,
one-line errors (refused, 401, 404 model, a server killed mid-reply) that leave the session file as it was,
and the chat-completions fallback for a model with no local tokenizer."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli_util import read_session

KEY = "remote-test-key"


def start_server(model: Path, tmp: Path, api_key: str | None = None):
    """`pagedchat serve` on a free port, starting; call the returned function for (process, base URL) once
    it listens (two servers start side by side)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "server-config"), "PYTHONUNBUFFERED": "1"}
    env.pop("PAGEDCHAT_API_KEY", None)
    args = [sys.executable, "-m", "pagedchat.cli", "serve", "-m", str(model), "--port", "0", "--device", "cpu",
            "--kv-memory", "2MiB", "--threads", "1"] + (["--api-key", api_key] if api_key else [])
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def listening() -> tuple[subprocess.Popen, str]:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"pagedchat serve did not start: {proc.communicate(timeout=10)[1][-2000:]}")
        assert line.startswith("pagedchat serve: http://"), line
        return proc, line.split()[2]
    return listening


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """Two `pagedchat serve` processes: one shared (with an API key), one for the test that kills it."""
    starting = [start_server(model, tmp_path_factory.mktemp("serve"), api_key=KEY),
                start_server(model, tmp_path_factory.mktemp("doomed"))]
    procs = []
    try:
        for listening in starting:
            procs.append(listening())
        yield procs
    finally:
        for proc, _ in procs:
            stop(proc)


@pytest.fixture(scope="module")
def server(servers):
    return servers[0][1]


@pytest.fixture(scope="module")
def cache():
    return {}


def local_reference(cache, cli, model, xdg_home) -> list[dict]:
    """The local engine's three turns of session `here` (--json outputs), computed once per module; the
    session file is kept with them."""
    if "turns" not in cache:
        cache["turns"] = turns(cli, ["-m", str(model), "--device", "cpu"], "here", PROMPTS)
        cache["session"] = read_session(xdg_home, "here")
    return cache["turns"]


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_API_KEY", KEY)


def run_json(cli, *args) -> dict:
    code, out, err = cli("run", "-t", "0", "--max-tokens", "12", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def turns(cli, where: list[str], session: str, prompts: list[str]) -> list[dict]:
    return [run_json(cli, *where, "--session", session, p) for p in prompts]


PROMPTS = ["hello world", "what is 17 + 25?", "and the quick brown fox?"]


def test_run_session_over_server_equals_local_run(server, model, pagedchat_cli, xdg_home, keyed, cache):
    local = local_reference(cache, pagedchat_cli, model, xdg_home)
    remote = turns(pagedchat_cli, ["--server", server, "-m", str(model)], "there", PROMPTS)
    for a, b in zip(local, remote):
        assert b["outputs"] == a["outputs"]
        assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
        assert b["remote"]["endpoint"] == "/v1/completions" and b["remote"]["history"] == "token-exact"
    # the server's prefix cache saw turn 1's prompt and reply as the prefix of turn 2's prompt
    assert remote[1]["usage"]["prompt_cached_tokens"] >= 16
    assert remote[1]["remote"]["cached_tokens"] == remote[1]["usage"]["prompt_cached_tokens"]
    # the session files hold the same nodes, token ids included
    strip = lambda s: [(n["role"], n["text"], n["token_ids"]) for n in s["nodes"]]  # noqa: E731
    assert strip(read_session(xdg_home, "there")) == strip(cache["session"])


def test_one_shot_run_over_server_equals_local(server, model, pagedchat_cli, xdg_home, keyed, cache):
    local = local_reference(cache, pagedchat_cli, model, xdg_home)[0]    # a session's first turn = one shot
    # no -m: the server names its model by its folder, which holds the tokenizer and template
    remote = run_json(pagedchat_cli, "--server", server.removesuffix("/v1"), "hello world")
    assert remote["outputs"] == local["outputs"] and remote["remote"]["history"] == "token-exact"
    code, out, err = pagedchat_cli("run", "--server", server, "-t", "0", "--max-tokens", "12", "hello world")
    assert code == 0 and out.startswith(local["outputs"][0]["text"]), err


def test_session_moves_between_local_and_server(server, model, pagedchat_cli, xdg_home, keyed, cache):
    here = ["-m", str(model), "--device", "cpu"]
    there = ["--server", server, "-m", str(model)]
    reference = local_reference(cache, pagedchat_cli, model, xdg_home)
    moved = [run_json(pagedchat_cli, *where, "--session", "moved", p)
             for where, p in zip([here, there, here], PROMPTS)]
    assert [m["outputs"] for m in moved] == [r["outputs"] for r in reference]
    assert "remote" in moved[1] and "remote" not in moved[2]


def test_fork_regen_and_edit_through_the_controller(server, model, tmp_path, keyed):
    from pagedchat.chat.app import start
    from pagedchat.chat.store import SessionStore
    from pagedchat.settings import ModelOptions, SamplingOptions

    ctl, _ = start(ModelOptions(model=str(model), server=server), SamplingOptions(temperature=0, max_tokens=6),
                   "tree", False, None, show_progress=False, store=SessionStore(tmp_path))
    first = ctl.send("hello world")
    fork = ctl.fork(3)
    assert len(fork.replies) == 3 and [r.variant for r in fork.replies] == [1, 2, 3]
    assert {r.parent for r in fork.replies} == {first.user.id}
    assert len(ctl.session.tree.children(first.user.id)) == 4
    tok = ctl.backend.tokenizer
    assert all(r.token_ids and r.text == tok.decode(r.token_ids, skip_special_tokens=True)[:len(r.text)]
               for r in fork.replies)
    regen = ctl.regen()
    assert regen.replies[0].parent == first.user.id
    edited = ctl.edit(first.user.id, "what is 17 + 25?")
    assert edited.user.parent == first.user.parent and edited.user.id != first.user.id
    stats = ctl.pool_stats()
    assert stats["remote"]["history"] == "token-exact" and stats["last_turn"]["remote"]["server"] == server
    saved = json.loads((tmp_path / "tree.json").read_text())
    assert len(saved["nodes"]) == len(ctl.session.tree)


def test_killed_server_mid_reply_leaves_the_session_intact(servers, model, pagedchat_cli, xdg_home, monkeypatch):
    from pagedchat.chat import remote_backend

    proc, url = servers[1]
    base = ["run", "--server", url, "-m", str(model), "--session", "k", "-t", "0"]
    code, _, err = pagedchat_cli(*base, "--max-tokens", "4", "hello world")
    assert code == 0, err
    path = xdg_home / "data" / "pagedchat" / "sessions" / "k.json"
    before = path.read_bytes()
    add = remote_backend._Reply.add

    def kill_once_streaming(reply, *args):    # the first piece of the reply has arrived: kill the server
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        return add(reply, *args)

    monkeypatch.setattr(remote_backend._Reply, "add", kill_once_streaming)
    code, out, err = pagedchat_cli(*base, "--max-tokens", "400", "the quick brown fox")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err     # a failed reply, as locally (2: what the user can fix)
    assert lines[0].startswith("pagedchat: error: the server at") and "before the reply finished" in lines[0]
    assert path.read_bytes() == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_models_toml(xdg_home: Path, text: str) -> None:
    folder = xdg_home / "config" / "pagedchat"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models.toml").write_text(text)


def one_line_error(pagedchat_cli, *args) -> str:
    code, out, err = pagedchat_cli("run", *args)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pagedchat: error: "), err
    return lines[0]


def test_errors_are_one_line_and_save_nothing(server, model, pagedchat_cli, xdg_home, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert "cannot connect" in one_line_error(pagedchat_cli, "--server", url, "-m", str(model), "--session", "e", "hi")
    monkeypatch.setenv("PAGEDCHAT_API_KEY", "wrong")
    assert "refused the API key (401)" in one_line_error(pagedchat_cli, "--server", server, "-m", str(model),
                                                         "--session", "e", "hi")
    monkeypatch.setenv("PAGEDCHAT_API_KEY", KEY)
    write_models_toml(xdg_home, f'[models.far]\nkind = "remote"\nserver = "{server}"\nmodel = "nope"\n'
                                f'path = "{model}"\n')
    assert "has no model 'nope' (404)" in one_line_error(pagedchat_cli, "-m", "far", "--session", "e", "hi")
    assert not (xdg_home / "data" / "pagedchat" / "sessions" / "e.json").exists()
    # an api_key in the remote entry is what the server is sent
    monkeypatch.delenv("PAGEDCHAT_API_KEY")
    write_models_toml(xdg_home, f'[models.far]\nkind = "remote"\nserver = "{server}"\nmodel = "{model}"\n'
                                f'api_key = "{KEY}"\ntokenizer = "{model}"\n')
    assert run_json(pagedchat_cli, "-m", "far", "hello world")["remote"]["history"] == "token-exact"


def test_chat_completions_when_no_local_tokenizer(server, model, pagedchat_cli, xdg_home, keyed, cache):
    write_models_toml(xdg_home, f'[models.far]\nkind = "remote"\nserver = "{server}"\nmodel = "{model}"\n')
    import httpx

    local = local_reference(cache, pagedchat_cli, model, xdg_home)[0]
    remote = turns(pagedchat_cli, ["-m", "far"], "text", PROMPTS[:2])
    # turn 1: the server renders the same template, so the same reply
    assert remote[0]["outputs"][0]["text"] == local["outputs"][0]["text"]
    for turn in remote:
        assert turn["remote"] == {**turn["remote"], "endpoint": "/v1/chat/completions", "history": "text-exact"}
    # turn 2 went as messages: the history as text (a random model's replies are not all valid UTF-8, so
    # this differs from the token-exact history the local engine continues from: that is what text-exact means)
    messages = [{"role": "user", "content": PROMPTS[0]},
                {"role": "assistant", "content": remote[0]["outputs"][0]["text"]},
                {"role": "user", "content": PROMPTS[1]}]
    direct = httpx.post(server + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"model": str(model), "messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert remote[1]["outputs"][0]["text"] == direct["choices"][0]["message"]["content"]
    saved = read_session(xdg_home, "text")
    assert saved["fingerprint"] == {"history": "text"}
    # the local engine has no ids to continue such a session from: one line, nothing changed
    assert "recorded as text only" in one_line_error(pagedchat_cli, "-m", str(model), "--device", "cpu",
                                                     "--session", "text", "more")
    assert read_session(xdg_home, "text") == saved


def test_remote_entries_are_checked(pagedchat_cli, xdg_home):
    write_models_toml(xdg_home, '[models.far]\nkind = "remote"\nmodel = "x"\n')
    assert "needs `server`" in one_line_error(pagedchat_cli, "-m", "far", "hi")
    write_models_toml(xdg_home, '[models.near]\nsource = "/x"\nserver = "http://h:1"\n')
    assert "server is for kind = \"remote\" entries" in one_line_error(pagedchat_cli, "-m", "near", "hi")


@pytest.mark.skipif(shutil.which("llama-server") is None, reason="llama.cpp's llama-server is not on PATH")
@pytest.mark.skipif(not os.environ.get("PAGEDCHAT_TEST_GGUF"),
                    reason="PAGEDCHAT_TEST_GGUF (a GGUF file of a model whose HF folder is PAGEDCHAT_TEST_GGUF_HF) "
                           "is not set")
def test_llama_server(pagedchat_cli, tmp_path):
    """llama.cpp's server: token-id prompts to /v1/completions; it returns no token ids, so replies are
    re-encoded locally (text-exact) and the turn still works."""
    port = free_port()
    proc = subprocess.Popen(["llama-server", "-m", os.environ["PAGEDCHAT_TEST_GGUF"], "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx
        import time

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        out = run_json(pagedchat_cli, "--server", f"http://127.0.0.1:{port}/v1", "-m",
                       os.environ["PAGEDCHAT_TEST_GGUF_HF"], "--session", "llama", "hello")
        assert out["outputs"][0]["token_ids"] and out["remote"]["endpoint"] == "/v1/completions"
    finally:
        stop(proc)


# -- the wire without a server: httpx's MockTransport plays servers pagedchat serve is not ---------------------
def fake_backend(model, handler, tokenizer=True):
    import httpx

    from pagedchat.chat.remote_backend import RemoteBackend
    from pagedchat.model.loader import load_tokenizer
    from pagedchat.remote import Server, ServerConfig

    server = Server(ServerConfig("http://fake/v1", model="m"))
    server.client = httpx.Client(base_url=server.url, transport=httpx.MockTransport(handler))
    return RemoteBackend(server, "m", load_tokenizer(model) if tokenizer else None, [2], 512)


def sse(*chunks) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_a_server_that_refuses_token_id_prompts_gets_messages(model):
    """The fallback: a 400 about the prompt moves the backend to chat completions for good, says so, and
    the reply is stored as the local tokenizer reads its text (text-exact)."""
    import httpx

    from pagedchat.engine import SamplingParams

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path.endswith("/completions") and "chat" not in request.url.path:
            return httpx.Response(400, json={"error": {"message": "prompt must be a string", "param": "prompt"}})
        return httpx.Response(200, content=sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "hello"}}]},
            {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 4}}}))

    backend = fake_backend(model, handler)
    messages = [{"role": "user", "content": "hi"}]
    done = backend.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), None, None, messages=messages)
    out = done.output.outputs[0]
    assert [path for path, _ in seen] == ["/v1/completions", "/v1/chat/completions"]
    assert seen[0][1]["prompt"] == [1, 2, 3] and seen[1][1]["messages"] == messages
    assert out.text == "hello world" and out.finish_reason == "stop" and not done.interrupted
    assert out.token_ids == list(backend.tokenizer("hello world", add_special_tokens=False).input_ids)
    assert done.output.prefix_hit_tokens == 4
    assert backend.describe()["history"] == "text-exact" and "text-exact" in backend.notes[0]


def test_a_server_that_refuses_return_token_ids_is_asked_again_without_it(model):
    import httpx

    from pagedchat.engine import SamplingParams

    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append("return_token_ids" in body)
        if "return_token_ids" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument supplied: "
                                                                  "return_token_ids"}})
        return httpx.Response(200, content=sse({"choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]}))

    backend = fake_backend(model, handler)
    done = backend.generate([5, 6], SamplingParams(temperature=0, max_tokens=2), None, None, messages=[])
    assert asked == [True, False] and done.output.outputs[0].text == "ab"
    assert backend.describe()["history"] == "text-exact"    # the ids are the local reading of the text


def test_ctrl_c_keeps_the_partial_reply(model):
    import httpx

    from pagedchat.engine import SamplingParams

    def handler(request: httpx.Request) -> httpx.Response:
        def chunks():
            yield sse({"choices": [{"index": 0, "text": "par", "token_ids": [40, 41]}]})[:-len(b"data: [DONE]\n\n")]
            raise KeyboardInterrupt     # Ctrl-C while the next chunk is awaited
        return httpx.Response(200, content=chunks())

    done = fake_backend(model, handler).generate([1], SamplingParams(max_tokens=9), None, None, messages=[])
    out = done.output.outputs[0]
    assert done.interrupted and out.text == "par" and out.token_ids == [40, 41] and out.finish_reason == "abort"


def test_a_server_that_answers_nothing_times_out_in_one_line():
    from pagedchat.remote import RemoteError, Server, ServerConfig

    with socket.socket() as listener:      # accepts connections (the backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        server = Server(ServerConfig(f"http://127.0.0.1:{listener.getsockname()[1]}", read_timeout_s=0.3))
        with pytest.raises(RemoteError, match=r"sent nothing for 0.3s"):
            server.models()


def test_a_prompt_too_long_is_an_error_not_a_fallback(model):
    import httpx

    from pagedchat.engine import SamplingParams
    from pagedchat.remote import RemoteError

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {
            "message": "This model's maximum context length is 512 tokens. However, your prompt resulted in 900 "
                       "tokens.", "code": "context_length_exceeded", "param": "prompt"}})

    backend = fake_backend(model, handler)
    with pytest.raises(RemoteError, match="answered 400: This model's maximum context length is 512"):
        backend.generate([1] * 900, SamplingParams(max_tokens=4), None, None, messages=[])
    assert backend.describe()["endpoint"] == "/v1/completions"


def test_beam_over_the_server_equals_the_local_beam(server, model, tmp_path, keyed):
    """/beam W where the server supports it (pagedchat serve: use_beam_search): the same W hypotheses, in
    the same order, as the local engine's beam search."""
    from pagedchat.chat.app import start
    from pagedchat.chat.store import SessionStore
    from pagedchat.settings import ModelOptions, SamplingOptions

    results = []
    for where in (dict(device="cpu"), dict(server=server)):
        ctl, _ = start(ModelOptions(model=str(model), **where), SamplingOptions(temperature=0, max_tokens=5),
                       None, False, None, show_progress=False, store=SessionStore(tmp_path / str(len(results))))
        results.append([r.token_ids for r in ctl.beam(3, "hello world").replies])
    assert len(results[0]) == 3 and results[1] == results[0]
