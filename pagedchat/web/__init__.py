"""The chat page `pagedchat serve` shows at /: the conversation tree in a browser, on the server's own engine,
pool and the REPL's session files.

    backend.py   the chat layer's backend inside the server: engine calls on its loop thread, turns streamed
    service.py   open sessions (one ChatController each), revision checks, exports, the pool per session
    routes.py    the page's HTTP API under /api (server-sent events for turns) and the static files
    static/      the page: index.html, app.js, style.css and the vendored markdown-it (no build step)
"""

from __future__ import annotations


def mount(app, entry, store=None, system: str | None = None):
    """Serve the page and its API on the server's app (made by serve.app.create_app); returns the WebChat."""
    from pagedchat.web.routes import install
    from pagedchat.web.service import WebChat

    web = WebChat(app.state.aengine, entry, store, system)
    install(app, web)
    app.state.web = web
    return web
