"""`pagedchat serve` end to end: a real uvicorn server on a loopback port, driven by the official openai client.

One tiny random llama (tests/hf_models.py) is served for the whole module from a background thread; the
last test starts the `pagedchat serve` command itself in a subprocess. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from hf_models import build_model
from serve_util import serving

KEY = "test-key-123"
NAME = "tiny-llama"
CONTEXT = 1024
BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "llama"
    hf = build_model("llama", path, max_position_embeddings=CONTEXT)
    return path, hf


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """(base_url, tokenizer) of a server running in a thread of this process; stopped after the module."""
    from pagedchat.settings import ModelOptions, load_engine
    from pagedchat.serve import AsyncEngine, create_app
    from pagedchat.serve.server import settings_for

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))   # no user models.toml
        engine, entry = load_engine(ModelOptions(model=str(model[0]), device="cpu", kv_memory="2MiB",
                                                 block_size=BLOCK), show_progress=False)
    aengine = AsyncEngine(engine)
    app = create_app(aengine, settings_for(entry, KEY, NAME))
    with serving(app) as url:
        yield url, engine.tokenizer


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=KEY, timeout=60, max_retries=0)


def stats(server) -> dict:
    r = httpx.get(server[0] + "/pagedchat/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def wait_idle(server, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        if s["running"] == 0 and s["waiting"] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def chat(client, content, system=None, **kw):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return client.chat.completions.create(model=NAME, messages=messages, **kw)


def prompt_ids(tokenizer, content, system=None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# -- basics ------------------------------------------------------------------------------------------------------
def test_models_health_and_stats(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0].removesuffix("/v1") + "/health", timeout=10).json() == {"status": "ok"}
    s = stats(server)
    assert s["pool"]["num_blocks"] * s["pool"]["block_size"] == s["pool"]["capacity_tokens"] > 0
    assert s["pool"]["block_size"] == BLOCK and s["pool"]["kv_dtype"] == "float32"


def test_chat_greedy_equals_hf_generate(server, client, model):
    """The server's greedy reply is the HF model's greedy continuation of the chat-templated prompt."""
    tokenizer, hf = server[1], model[1]
    reply = chat(client, "hello world, how are you?", temperature=0, max_tokens=10)
    ids = prompt_ids(tokenizer, "hello world, how are you?")
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == ("stop" if out[0, -1].item() == 2 else "length")
    assert reply.model == NAME and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == out.shape[1] - len(ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_matches_non_streaming(client):
    kw = dict(temperature=0, max_tokens=12)
    full = chat(client, "the quick brown fox", **kw)
    stream = chat(client, "the quick brown fox", stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n3_variants_share_the_prompt(server, client):
    greedy = chat(client, "paged attention keeps", temperature=0, max_tokens=8)
    before = stats(server)["pool"]["cow_copies"]
    three = chat(client, "paged attention keeps", temperature=0, max_tokens=8, n=3)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    # Greedy forks of one prefill reproduce the single greedy answer: copy-on-write kept them apart.
    assert [c.message.content for c in three.choices] == [greedy.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == greedy.usage.prompt_tokens           # the prompt counts once
    assert three.usage.completion_tokens == 3 * greedy.usage.completion_tokens
    if greedy.usage.prompt_tokens % BLOCK:  # the partial prompt block is shared, so writing it copies it
        assert stats(server)["pool"]["cow_copies"] > before
    sampled = chat(client, "paged attention keeps", temperature=1.0, max_tokens=8, n=3, seed=7, stream=True)
    texts, finished = {}, set()
    for chunk in sampled:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    again = chat(client, "paged attention keeps", temperature=1.0, max_tokens=8, n=3, seed=7)
    assert [again.choices[i].message.content for i in range(3)] == [texts[i] for i in range(3)]  # seeded


def test_stop_strings(client):
    full = client.completions.create(model=NAME, prompt="a b c d e f", temperature=0, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip()]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[len(clean) // 2]:clean[len(clean) // 2] + 2]
    expected = full[:full.index(stop)]
    got = client.completions.create(model=NAME, prompt="a b c d e f", temperature=0, max_tokens=24,
                                    stop=[stop, "never-produced-xyz"], extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt="a b c d e f", temperature=0, max_tokens=24, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_completions_prompt_forms(server, client):
    tokenizer = server[1]
    ids = list(tokenizer("hello world").input_ids)
    by_text = client.completions.create(model=NAME, prompt="hello world", temperature=0, max_tokens=6)
    by_ids = client.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=NAME, prompt=["hello world", "the quick brown"], temperature=0,
                                      max_tokens=6, n=2)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer("the quick brown").input_ids)


# -- concurrency, disconnects, the prefix cache --------------------------------------------------------------------
def test_32_concurrent_streams_queue_when_the_pool_is_full_then_idle(server):
    """32 streams that together need more KV than the pool: they queue (or are preempted and resumed),
    never fail, every one gets all its tokens, and the pool is back to idle afterwards."""
    max_tokens = 120
    pool = stats(server)["pool"]

    async def one(client, i):
        stream = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"client {i}: what is {i} + {i}?"}],
            max_tokens=max_tokens, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=server[0], api_key=KEY, timeout=120, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 240)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert sum(u.prompt_tokens + u.completion_tokens for _, _, u in results) > pool["capacity_tokens"]
    assert [(finish, usage.completion_tokens) for _, finish, usage in results] == [("length", max_tokens)] * 32
    idle = wait_idle(server)
    assert idle["running"] == 0 and idle["waiting"] == 0
    assert idle["pool"]["used"] == 0                      # nothing pinned by the server: every block is free
    assert idle["pool"]["free"] == idle["pool"]["num_blocks"]
    assert idle["pool"]["peak_used"] > pool["num_blocks"] // 2   # they really shared the pool at once


def test_client_disconnect_mid_stream_frees_blocks(server):
    aborted = stats(server)["requests"]["aborted"]
    body = {"model": NAME, "prompt": "hello", "max_tokens": CONTEXT - 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server[0] + "/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
            assert len(data) >= 3
            busy = stats(server)
            assert busy["running"] == 1 and busy["pool"]["used"] > 0
        # leaving the block closes the connection mid-stream
    idle = wait_idle(server, timeout=10)
    assert idle["running"] == 0 and idle["pool"]["used"] == 0
    assert idle["requests"]["aborted"] == aborted + 1      # stopped by the abort, not by finishing


def test_client_gone_during_a_non_streaming_request_aborts_it(server):
    aborted = stats(server)["requests"]["aborted"]
    body = {"model": NAME, "prompt": "hello", "max_tokens": CONTEXT - 100, "temperature": 0, "ignore_eos": True}
    # The client gives up (and closes the connection) after 0.1 s; hundreds of decode steps take longer.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server[0] + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=0.1))
    idle = wait_idle(server, timeout=10)
    assert idle["running"] == 0 and idle["pool"]["used"] == 0
    assert idle["requests"]["aborted"] == aborted + 1


def test_shared_system_prompt_hits_the_prefix_cache(server):
    tokenizer = server[1]
    system = "You are a helpful assistant. " + " ".join(f"rule {i}: be brief and kind." for i in range(30))
    users = [f"question {i}: what is {i} times {i}?" for i in range(16)]
    before = stats(server)["pool"]["prefix_hit_tokens"]

    async def ask(client, user):
        return await client.chat.completions.create(
            model=NAME, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=4, temperature=0)

    async def main():
        client = openai.AsyncOpenAI(base_url=server[0], api_key=KEY, timeout=120, max_retries=0)
        try:
            await ask(client, "warm up")  # computes the system prompt's blocks once
            return await asyncio.wait_for(asyncio.gather(*(ask(client, u) for u in users)), 180)
        finally:
            await client.close()

    replies = asyncio.run(main())
    warm = prompt_ids(tokenizer, "warm up", system)
    for reply, user in zip(replies, users):
        ids = prompt_ids(tokenizer, user, system)
        common = next(i for i, (a, b) in enumerate(zip(ids, warm)) if a != b)
        assert common > 200
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert reply.usage.prompt_tokens == len(ids)
        assert common // BLOCK * BLOCK <= cached < len(ids)
    after = wait_idle(server)
    assert after["pool"]["prefix_hit_tokens"] - before >= sum(r.usage.prompt_tokens_details.cached_tokens
                                                              for r in replies)
    assert after["pool"]["prefix_hit_rate"] > 0 and after["pool"]["used"] == 0


# -- errors ----------------------------------------------------------------------------------------------------
def _assert_shape(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors(server, client):
    url = server[0]
    auth = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "hi"}]

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/chat/completions", json={"model": NAME, "messages": msgs}, headers=headers, timeout=30)
        assert r.status_code == 401 and _assert_shape(r.json())["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=30).models.list()

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=msgs)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"

    cases = [({"temperature": -1}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
             ({"frequency_penalty": 1}, "frequency_penalty"), ({"top_logprobs": 2}, "top_logprobs"),
             ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]"),
             ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 5}, "stop"),
             ({"made_up_field": 1}, "made_up_field")]
    for extra, param in cases:
        r = httpx.post(url + "/chat/completions", json={"model": NAME, "messages": msgs, **extra}, headers=auth,
                       timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = _assert_shape(r.json())
        assert error["param"] == param and param in error["message"], (extra, error)

    for body in ({"model": NAME}, {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": msgs}):
        r = httpx.post(url + "/chat/completions", json=body, headers=auth, timeout=30)
        assert r.status_code == 400 and _assert_shape(r.json())["param"], r.text
    r = httpx.post(url + "/chat/completions", content=b"{not json", headers={**auth, "Content-Type":
                                                                           "application/json"}, timeout=30)
    assert r.status_code == 400 and _assert_shape(r.json())
    r = httpx.get(url + "/no/such/route", headers=auth, timeout=30)
    assert r.status_code == 404 and _assert_shape(r.json())

    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hello world " * 600, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "1024" in e.value.message
    _assert_shape(e.value.response.json())
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[1, 2, 10**6], max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "prompt"

    # No-op values of unsupported fields are accepted, and so are the model's path and its alias names.
    ok = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, presence_penalty=0,
                                        frequency_penalty=0.0, logprobs=False, user="me")
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert wait_idle(server)["pool"]["used"] == 0


# -- the command itself --------------------------------------------------------------------------------------------
def test_pagedchat_serve_command_starts_serves_and_stops_on_ctrl_c(model, tmp_path):
    env = {**os.environ, "PAGEDCHAT_API_KEY": "env-key", "XDG_CONFIG_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedchat.cli", "serve", "-m", str(model[0]), "--port", "0",
                             "--device", "cpu", "--kv-memory", "1MiB"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=120)
        pool = re.search(r"KV pool (\d+) blocks x 16 = (\d+) tokens", line)
        assert line.startswith("pagedchat serve: http://127.0.0.1:") and f" model {model[0]} " in line, line
        assert pool and int(pool[1]) * 16 == int(pool[2]) > 0, line
        url = line.split()[2]
        client = openai.OpenAI(base_url=url, api_key="env-key", timeout=60, max_retries=0)
        reply = client.chat.completions.create(model=str(model[0]), messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="other", max_retries=0, timeout=30).models.list()
        # Ctrl-C while a long stream is open: the stream ends with an error event and the process exits.
        streamed: queue.Queue = queue.Queue()

        def listen():
            body = {"model": str(model[0]), "prompt": "hi", "max_tokens": 900, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/completions", json=body, timeout=60,
                              headers={"Authorization": "Bearer env-key"}) as response:
                for chunk in response.iter_lines():
                    streamed.put(chunk)
            streamed.put(None)

        threading.Thread(target=listen, daemon=True).start()
        assert streamed.get(timeout=60).startswith("data: ")
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=30)[1]
        tail = []
        while (item := streamed.get(timeout=30)) is not None:
            tail += [item] if item else []
        assert tail[-1] == "data: [DONE]" and "server_shutting_down" in tail[-2], tail[-2:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "pagedchat serve: stopped" in stderr


def test_beam_search_as_vllm_takes_it(server, client, model):
    """use_beam_search + best_of beams, the n best returned (best first), as transformers' beam search."""
    from beam_oracle import beam_reference

    ids = server[1]("hello world").input_ids
    reply = client.completions.create(model=NAME, prompt=ids, max_tokens=8, n=2,
                                      extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5})
    expected = beam_reference(model[1], ids, 4, 8, 0.5)[:2]
    texts = [server[1].decode(tokens, skip_special_tokens=True) for tokens, _ in expected]
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == texts
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=NAME, prompt=ids, max_tokens=2, n=3,
                                  extra_body={"use_beam_search": True, "best_of": 2})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=NAME, prompt=ids, max_tokens=2, extra_body={"best_of": 2})


def test_a_streamed_event_stays_one_line_for_clients_that_split_with_splitlines():
    """A reply may hold U+0085, U+2028 or U+2029 (a model samples any token): JSON leaves them raw, and httpx's
    aiter_lines (str.splitlines) cut such an event in two ("Unterminated string", found by `bench serve` at
    70 req/s). Escaped, every client reads one line and the same text."""
    import json

    from httpx._decoders import LineDecoder

    from pagedchat.serve.app import _sse

    body = {"choices": [{"delta": {"content": "a\x85b\u2028c\u2029d é\n"}}]}
    lines = [line for line in LineDecoder().decode(_sse(body)) if line]
    assert len(lines) == 1 and json.loads(lines[0].removeprefix("data: ")) == body
