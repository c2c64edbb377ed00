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


@contextlib.contextmanager
def serving_page(model: str, sessions, api_key: str | None = None, kv_memory: str = "8MiB", allowed_hosts=()):
    """Yield (page URL http://127.0.0.1:PORT/, AsyncEngine) of `pagedchat serve -m MODEL` as the command builds it:
    the OpenAI API, the chat page on the session folder `sessions`, behind the Host/Origin guard."""
    import uvicorn  # noqa: F401  (serving() needs it)

    from pagedchat.chat.store import SessionStore
    from pagedchat.serve import AsyncEngine, create_app
    from pagedchat.serve.guard import HostGuard
    from pagedchat.serve.server import settings_for
    from pagedchat.settings import ModelOptions, load_engine
    from pagedchat.web import mount

    engine, entry = load_engine(ModelOptions(model=str(model), device="cpu", kv_memory=kv_memory), show_progress=False)
    aengine = AsyncEngine(engine)
    app = create_app(aengine, settings_for(entry, api_key, None))
    mount(app, entry, SessionStore(sessions))
    with serving(HostGuard(app, "127.0.0.1", allowed_hosts)) as url:
        yield url.removesuffix("v1"), aengine


@contextlib.contextmanager
def slow_steps(aengine, seconds: float):
    """Every engine step takes `seconds` longer while inside: a reply streams long enough to be stopped or seen
    arriving in pieces."""
    real = aengine.engine.step

    def step():
        time.sleep(seconds)
        return real()
    aengine.engine.step = step
    try:
        yield
    finally:
        aengine.engine.step = real
