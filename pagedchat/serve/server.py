"""Running the app: bind the socket first (clear error if the port is taken), load the model, print one
line, serve with uvicorn until Ctrl-C, exit cleanly."""

from __future__ import annotations

import ipaddress
import socket
import sys

from pagedchat.errors import UserError
from pagedchat.settings import check_overflow


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror} (pick another --port)") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def page_url(sock: socket.socket) -> str:
    """The chat page's address: a wildcard bind is shown as localhost (the name the page answers to)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "localhost"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def settings_for(entry, api_key: str | None, served_model_name: str | None, context_overflow: str | None = None):
    from pagedchat.serve.app import ServeSettings

    table = entry.table or {}
    accepted = {entry.name, str(entry.path), entry.source, *(table.get("aliases") or [])}
    if served_model_name:
        accepted.add(served_model_name)
    system = entry.get("system_prompt").value
    return ServeSettings(
        model_name=served_model_name or entry.name,
        accepted_models={a for a in accepted if a},
        api_key=api_key or None,
        sampling_defaults={k: s.value for k, s in entry.sampling_defaults().items()},
        system_prompt=system or None,
        template_kwargs=entry.get("chat_template_kwargs").value or None,
        context_overflow=context_overflow or check_overflow(entry.get("context_overflow").value,
                                                            "context_overflow in models.toml") or "stop",
    )


def run_server(model_opts, host: str, port: int, api_key: str | None, served_model_name: str | None = None,
               verbose: bool = False, context_overflow: str | None = None, web: bool = True,
               allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()) -> None:
    import uvicorn

    from pagedchat.settings import load_engine
    from pagedchat.serve.app import create_app
    from pagedchat.serve.async_engine import AsyncEngine
    from pagedchat.serve.guard import HostGuard

    sock = bind_socket(host, port)
    if not is_loopback(host) and not api_key:
        print(f"pagedchat serve: warning: listening on {host} without --api-key: anyone who can reach this "
              f"machine can use the server", file=sys.stderr)
    try:
        engine, entry = load_engine(model_opts)
        aengine = AsyncEngine(engine)
        app = create_app(aengine, settings_for(entry, api_key, served_model_name, context_overflow))
        page = None
        if web:
            from pagedchat.web import mount

            page = mount(app, entry)
        guarded = HostGuard(app, host, allowed_hosts, allowed_origins)
        config = uvicorn.Config(guarded, log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_graceful_shutdown=5, lifespan="on")
        server = _make_server(config, aengine, page)
        pool = engine.pool_stats()
        name = served_model_name or entry.name
        print(f"pagedchat serve: {url_of(sock)}  model {name}  KV pool {pool.num_blocks} blocks x "
              f"{pool.block_size} = {pool.capacity_tokens} tokens ({pool.kv_dtype})  (Ctrl-C to stop)", flush=True)
        if web:
            print(f"pagedchat serve: chat page at {page_url(sock)}", flush=True)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it handled once it has shut down
            pass
        print("pagedchat serve: stopped", file=sys.stderr, flush=True)
    finally:
        sock.close()


def _make_server(config, aengine, page=None):
    """A uvicorn.Server that ends open streams at once on Ctrl-C instead of waiting for them to finish (and the
    chat page's turns, `page` its WebChat)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = aengine.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(aengine.close_open_groups)
            if page is not None:
                page.stop_all()     # the page's turns end at their next step, kept and saved
            super().handle_exit(sig, frame)

    return Server(config)
