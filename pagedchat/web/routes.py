"""The web page's HTTP API (under /api, documented in docs/web.md) and the page itself at /.

Turns answer as server-sent events on the POST that starts them: `start`, `delta` ({index, text}: text the
variant `index` added), then `done` ({session, notes, stats}) or `error` ({message, status}). A client that goes
away stops its turn at the next step; the reply is kept, marked interrupted, as Ctrl-C does in the REPL.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from pagedchat.chat.store import StaleSession
from pagedchat.errors import UserError
from pagedchat.serve.protocol import APIError
from pagedchat.settings import MAX_FORK_VARIANTS
from pagedchat.web.service import Conflict, NoSession, WebChat, session_view

STATIC = resources.files("pagedchat.web") / "static"
PAGE_FILES = {"app.js": "text/javascript", "style.css": "text/css", "markdown-it.min.js": "text/javascript",
              "LICENSES.txt": "text/plain"}


class Change(BaseModel):
    model_config = ConfigDict(extra="forbid")
    revision: Optional[int] = None      # the session revision the page shows: stale pages are told to reload


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Optional[str] = None


class Message(Change):
    text: str
    n: int = 1                          # n > 1: a fork, the variants side by side


class Regenerate(Change):
    node_id: Optional[int] = None       # the reply (or user message) to answer again; default: the head
    n: int = 1


class Edit(Change):
    node_id: int
    text: str


class Branch(Change):
    node_id: int                        # the reply
    index: int                          # its token to replace
    token: str                          # the alternative (text or token id)


class Switch(Change):
    node_id: Optional[int] = None       # None: the top (the next message starts a new conversation)
    descend: bool = True                # follow the newest replies down to a leaf, as sibling arrows do


class Pick(Change):
    k: int


class System(Change):
    text: Optional[str] = None


class Setting(Change):
    key: str
    value: str


def install(app: FastAPI, web: WebChat) -> None:
    """Add the page and its API to the server's app (the OpenAI API is unchanged)."""
    api = APIRouter(prefix="/api", dependencies=[Depends(app.state.require_key)])
    aengine = app.state.aengine

    @app.get("/", include_in_schema=False)
    async def page():
        html = (STATIC / "index.html").read_text()
        return Response(html, media_type="text/html", headers=_PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in PAGE_FILES:
            return JSONResponse({"error": {"message": f"no page file {name!r}"}}, status_code=404)
        return Response((STATIC / name).read_bytes(), media_type=PAGE_FILES[name], headers=_PAGE_HEADERS)

    @api.get("/info")
    async def info():
        settings = app.state.settings
        return {"model": settings.model_name, "max_model_len": aengine.engine.max_model_len,
                "max_fork": MAX_FORK_VARIANTS, "key_required": settings.api_key is not None}

    @api.get("/sessions")
    async def sessions():
        return {"sessions": await _threaded(web.workers, web.list)}

    @api.post("/sessions")
    async def new_session(body: NewSession):
        session = await _threaded(web.workers, web.create, body.name)
        return session_view(session)

    @api.get("/sessions/{name}")
    async def get_session(name: str):
        entry = await _threaded(web.workers, web.session, name)
        return session_view(entry.controller.session)

    @api.get("/sessions/{name}/export")
    async def export(name: str, format: str = "markdown"):
        body, media = await _threaded(web.workers, web.export, name, format)
        suffix = "json" if media == "application/json" else "md"
        return Response(body, media_type=media,
                        headers={"content-disposition": f'attachment; filename="{name}.{suffix}"'})

    @api.get("/pool")
    async def pool():
        return await aengine.call(web.pool_reader())

    @api.post("/sessions/{name}/stop")
    async def stop(name: str):
        entry = await _threaded(web.workers, web.session, name)
        entry.backend.stop()
        return {"stopping": entry.busy.locked()}

    # -- changes that are not turns -------------------------------------------------------------------------
    async def change(name: str, revision: int | None, fn):
        return session_view(await _threaded(web.workers, web.change, name, revision, fn))

    @api.post("/sessions/{name}/switch")
    async def switch(name: str, body: Switch):
        def move(ctl):
            if body.node_id is None:
                ctl.clear()
            else:
                ctl.switch(ctl.session.node(body.node_id).id)
                if body.descend:
                    ctl.switch(ctl.session.tree.descend(body.node_id))
        return await change(name, body.revision, move)

    @api.post("/sessions/{name}/pick")
    async def pick(name: str, body: Pick):
        return await change(name, body.revision, lambda ctl: ctl.pick(body.k))

    @api.post("/sessions/{name}/system")
    async def system(name: str, body: System):
        return await change(name, body.revision, lambda ctl: ctl.set_system(body.text))

    @api.post("/sessions/{name}/settings")
    async def setting(name: str, body: Setting):
        return await change(name, body.revision, lambda ctl: ctl.set_option(body.key, body.value))

    # -- turns ----------------------------------------------------------------------------------------------
    async def turn(name: str, revision: int | None, run):
        entry = await _threaded(web.workers, web.begin, name, revision)
        return StreamingResponse(_start_turn(web, entry, run), media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})

    @api.post("/sessions/{name}/messages")
    async def message(name: str, body: Message):
        return await turn(name, body.revision, lambda ctl, update: ctl.send(body.text, body.n, on_update=update))

    @api.post("/sessions/{name}/regenerate")
    async def regenerate(name: str, body: Regenerate):
        def run(ctl, update):
            if body.node_id is not None:
                ctl.switch(body.node_id)
            return ctl.regen(body.n, on_update=update)
        return await turn(name, body.revision, run)

    @api.post("/sessions/{name}/edit")
    async def edit(name: str, body: Edit):
        return await turn(name, body.revision, lambda ctl, update: ctl.edit(body.node_id, body.text, on_update=update))

    @api.post("/sessions/{name}/branch")
    async def branch(name: str, body: Branch):
        def run(ctl, update):
            ctl.switch(body.node_id)
            return ctl.branch(body.index, body.token, on_update=update)
        return await turn(name, body.revision, run)

    app.include_router(api)


# The page runs no script it did not ship: model output is shown as text and Markdown with raw HTML off, and
# this policy stops anything injected anyway (inline handlers, foreign scripts, framing by other sites).
_PAGE_HEADERS = {"content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                                            "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                                            "base-uri 'none'; form-action 'none'",
                 "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache"}

async def _threaded(pool, fn, *args):
    """fn(*args) in a worker thread (the chat layer blocks on the engine); its user errors as HTTP errors."""
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    except (Conflict, StaleSession) as e:
        raise APIError(409, str(e), code="conflict") from None
    except NoSession as e:
        raise APIError(404, str(e), code="session_not_found") from None
    except UserError as e:
        raise APIError(400, str(e)) from None


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _start_turn(web: WebChat, entry, run):
    """Start one turn in a worker thread now (the session is released when it ends, whatever becomes of the
    response) and return the server-sent events of its answer."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def update(index: int, text: str) -> None:    # t: when the token reached the chat layer (the page's latency)
        loop.call_soon_threadsafe(events.put_nowait, ("text", index, text, time.time()))

    def work():
        try:
            result = run(entry.controller, update)
            view = session_view(entry.controller.session)
            last = ("done", {"session": view, "notes": result.notes, "save_error": result.save_error,
                             "interrupted": result.interrupted, "stats": _plain(result.stats),
                             "replies": [r.id for r in result.replies],
                             "user": result.user.id if result.user else None})
        except UserError as e:
            last = ("error", {"message": str(e), "status": 400})
        except Exception as e:  # a bug must end the stream with a message, not hang the page
            last = ("error", {"message": f"internal error: {type(e).__name__}: {e}", "status": 500})
        finally:
            web.end(entry)      # before the page hears of the end: its next change may follow at once
        loop.call_soon_threadsafe(events.put_nowait, last)

    loop.run_in_executor(web.workers, work)
    return _relay(entry, events)


async def _relay(entry, events: asyncio.Queue):
    """The turn's events as server-sent events: each variant's new text as a delta. A client that goes away
    stops the turn at its next step (the worker keeps the reply, marked interrupted, and saves it)."""
    sent: dict[int, str] = {}
    finished = False
    try:
        yield _sse("start", {"session": entry.controller.session.name})
        while True:
            item = await events.get()
            if item[0] == "text":
                _, index, text, t = item
                before = sent.get(index, "")
                sent[index] = text
                delta = {"index": index, "text": text[len(before):], "t": t} if text.startswith(before) else \
                    {"index": index, "text": text, "replace": True, "t": t}
                yield _sse("delta", delta)
                continue
            finished = True
            yield _sse(item[0], item[1])
            break
    finally:
        if not finished:
            entry.backend.stop()


def _plain(stats: dict) -> dict:
    """The turn's stats without the prompt's token ids (the page has no use for them)."""
    return {k: v for k, v in stats.items() if k != "prompt_token_ids"}
