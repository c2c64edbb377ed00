"""Run the real server app on a free loopback port in a background thread, for the tests."""

from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serving(app):
    """Yield the base URL (http://127.0.0.1:PORT/v1) while uvicorn serves `app`; stop it afterwards."""
    import uvicorn

    from pagedchat.serve.server import bind_socket, url_of

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the test server did not start"
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
    assert not thread.is_alive(), "the test server did not stop"


@contextlib.contextmanager
def serving_model(path, name: str, api_key: str | None = None, kv_memory: str = "2MiB"):
    """Yield (base URL, engine) of `pagedchat serve`'s app on the model folder `path`, named `name`."""
    import os
    import tempfile

    from pagedchat.serve import AsyncEngine, create_app
    from pagedchat.serve.server import settings_for
    from pagedchat.settings import ModelOptions, load_engine

    with tempfile.TemporaryDirectory() as config:
        old = os.environ.get("XDG_CONFIG_HOME")
        os.environ["XDG_CONFIG_HOME"] = config      # no user models.toml
        try:
            engine, entry = load_engine(ModelOptions(model=str(path), device="cpu", kv_memory=kv_memory),
                                        show_progress=False)
        finally:
            os.environ.pop("XDG_CONFIG_HOME") if old is None else os.environ.update(XDG_CONFIG_HOME=old)
    with serving(create_app(AsyncEngine(engine), settings_for(entry, api_key, name))) as url:
        yield url, engine
