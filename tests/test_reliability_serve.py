"""One oversized request never takes the server down: on a tiny pool, a request whose variants each outgrow
the whole pool fails alone (HTTP 400, kv_pool_exhausted) while concurrent requests complete, and the server
goes on serving with every block back in the pool."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hf_models import build_model
from serve_util import serving

KEY = "k"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pagedchat.settings import ModelOptions, load_engine
    from pagedchat.serve import AsyncEngine, create_app
    from pagedchat.serve.server import settings_for

    path = tmp_path_factory.mktemp("serve-rel") / "llama"
    build_model("llama", path, max_position_embeddings=1024)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        # one 16-token block of this model is 8 KiB: 10 blocks = 160 tokens
        engine, entry = load_engine(ModelOptions(model=str(path), device="cpu", kv_memory="80KiB"),
                                    show_progress=False)
    assert engine.pool.num_blocks == 10
    app = create_app(AsyncEngine(engine), settings_for(entry, KEY, "tiny"))
    with serving(app) as url:
        yield url, engine


def complete(url, **body):
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_oversized_variants_fail_alone_while_others_complete(server):
    url, engine = server
    with ThreadPoolExecutor(6) as pool:
        big = pool.submit(complete, url, prompt="hello world " * 4, max_tokens=400, n=3)
        small = [pool.submit(complete, url, prompt=f"the quick brown fox {i}", max_tokens=12) for i in range(5)]
        answers = [f.result() for f in small]
        failed = big.result()
    assert failed.status_code == 400, failed.text
    error = failed.json()["error"]
    assert error["code"] == "kv_pool_exhausted" and "whole pool" in error["message"]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    again = complete(url, prompt="still serving?", max_tokens=5)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
    deadline = time.monotonic() + 20
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.pool.num_used == 0 and not engine.scheduler.pins
