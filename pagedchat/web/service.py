"""The chat layer as the web page uses it: one ChatController per open session (the REPL's controller, not a
copy of it), all on the server's one engine and KV pool, sessions in the same files as the REPL's.

Each session has one writer at a time inside the server (a turn holds it until its reply ends), and every
change a page asks for names the revision the page shows: a page behind the saved session (another tab, the
REPL) is told so and reloads instead of overwriting. Turns run in worker threads (the controller blocks on
the engine); their text reaches the HTTP handler through `on_update`.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pagedchat.chat.controller import ChatController
from pagedchat.chat.render import export_markdown
from pagedchat.chat.session import Session, check_name
from pagedchat.chat.store import SessionStore
from pagedchat.chat.tree import Node
from pagedchat.errors import UserError
from pagedchat.web.backend import ServedBackend

MAX_TURNS = 16      # turns running at once over all sessions (each holds a worker thread while it streams)


class Conflict(UserError):
    """The page is behind the saved session, or the session is busy with another turn: reload or wait."""


class NoSession(UserError):
    """No session of that name, open or saved."""


@dataclass
class OpenSession:
    controller: ChatController
    backend: ServedBackend
    busy: threading.Lock = field(default_factory=threading.Lock)   # held by the turn or change running


class WebChat:
    def __init__(self, aengine, entry, store: SessionStore | None = None, system: str | None = None):
        self.aengine, self.entry = aengine, entry
        self.store = store or SessionStore()
        self.system = system
        self.open: dict[str, OpenSession] = {}
        self._opening = threading.Lock()
        self.workers = ThreadPoolExecutor(MAX_TURNS, thread_name_prefix="pagedchat-chat")

    def stop_all(self) -> None:
        """Any thread: every running turn ends at its next step, its reply kept and saved (interrupted), as
        Ctrl-C in the REPL does. The server calls it when it is stopped."""
        for entry in list(self.open.values()):
            entry.backend.stop()

    # -- sessions -------------------------------------------------------------------------------------------
    def _controller(self) -> tuple[ChatController, ServedBackend]:
        backend = ServedBackend(self.aengine)
        return ChatController(None, self.entry, self.store, system=self.system, overflow_default="drop-oldest",
                              backend=backend), backend

    def session(self, name: str) -> OpenSession:
        """The open session NAME (loaded from disk the first time), brought up to the saved revision."""
        check_name(name)
        with self._opening:
            entry = self.open.get(name)
            if entry is None:
                if not self.store.exists(name):
                    raise NoSession(f"no session named {name!r}")
                controller, backend = self._controller()
                controller.open_session(name)
                entry = self.open[name] = OpenSession(controller, backend)
        if entry.busy.acquire(blocking=False):   # (a turn running in it: it is the newest copy)
            try:
                self._catch_up(entry)
            finally:
                entry.busy.release()
        return entry

    def _catch_up(self, entry: OpenSession) -> None:
        """Reload the session if another writer saved a newer revision; pins of unchanged nodes are kept."""
        s = entry.controller.session
        on_disk = self.store.revision(s.name)
        if on_disk is None or on_disk == s.revision:
            return
        fresh = self.store.load(s.name)
        fresh.handles = {i: h for i, h in s.handles.items()
                         if i in fresh.tree and fresh.tree.get(i).token_ids == s.tree.get(i).token_ids}
        fresh.set_keys = s.set_keys
        entry.controller.sessions[s.name] = entry.controller.current = fresh

    def create(self, name: str | None = None) -> Session:
        controller, backend = self._controller()
        with self._opening:
            if name is not None and name in self.open:
                raise UserError(f"a session named {name!r} already exists")
            session = controller.new_session(name)
            self.store.save(session)       # a page's new session exists at once (the REPL's waits for a message)
            self.open[session.name] = OpenSession(controller, backend)
        return session

    def list(self) -> list[dict]:
        infos, _ = self.store.list()
        return [{"name": i.name, "model": i.model, "messages": i.messages, "branches": i.branches,
                 "updated": i.updated, "opens_here": self.opens_here(i.model)} for i in infos]

    def opens_here(self, model: str) -> bool:
        return not model or model in (self.entry.name, str(self.entry.path))

    # -- changes --------------------------------------------------------------------------------------------
    def begin(self, name: str, revision: int | None) -> OpenSession:
        """Take the session for one change based on `revision` (None: whatever is current). Conflict when
        another turn runs in it or the page is behind; the caller must call `end`."""
        entry = self.session(name)
        if not entry.busy.acquire(blocking=False):
            raise Conflict(f"a reply is still streaming in session {name}: stop it or wait for it")
        try:
            self._catch_up(entry)
            current = entry.controller.session.revision
            if revision is not None and revision != current:
                raise Conflict(f"session {name} was changed in another window or tab (revision {current}, this "
                               f"page showed {revision}): reloaded it")
        except BaseException:
            entry.busy.release()
            raise
        return entry

    @staticmethod
    def end(entry: OpenSession) -> None:
        entry.busy.release()

    def change(self, name: str, revision: int | None, fn) -> Session:
        """A change that is not a turn (switch, pick, system, settings): fn(controller) then save."""
        entry = self.begin(name, revision)
        try:
            fn(entry.controller)
            entry.controller.save_or_rebase(entry.controller.session)
            return entry.controller.session
        finally:
            self.end(entry)

    def export(self, name: str, form: str) -> tuple[str, str]:
        """(file body, media type) of the whole tree as Markdown or as the session's JSON."""
        session = self.session(name).controller.session
        if form == "json":
            return json.dumps(session.to_dict(), ensure_ascii=False, indent=1), "application/json"
        if form in ("md", "markdown"):
            return export_markdown(session, all_branches=True), "text/markdown"
        raise UserError(f"export format must be markdown or json, got {form!r}")

    # -- the pool -------------------------------------------------------------------------------------------
    def pool_reader(self):
        """A function of the engine (run it on the loop thread) giving the pool and, per open session, the blocks
        its branches hold and how many of them they share."""
        handles = {name: list(e.controller.session.handles.values()) for name, e in self.open.items()}

        def read(engine) -> dict:
            st = engine.stats()
            p = st.pool_stats
            sessions = {}
            for name, hs in handles.items():
                held, shared = engine.block_sharing(hs)
                sessions[name] = {"blocks": held, "shared_blocks": shared,
                                  "pinned_branches": sum(1 for h in hs if h.is_pinned)}
            return {"num_blocks": p.num_blocks, "block_size": p.block_size, "used": p.used, "free": p.free,
                    "cached": p.cached, "shared": p.shared, "prefix_hit_rate": round(p.prefix_hit_rate, 4),
                    "preemptions": st.preemptions, "running": st.running, "waiting": st.waiting,
                    "sessions": sessions}

        return read


def node_view(node: Node, tree) -> dict:
    """What the page draws of a node (its token ids stay on the server: the JSON export has them)."""
    siblings = tree.siblings(node.id)
    return {"id": node.id, "parent": node.parent, "role": node.role, "text": node.text,
            "children": [c.id for c in tree.children(node.id)], "sibling_pos": siblings.index(node) + 1,
            "siblings": len(siblings), "tokens": len(node.token_ids), "interrupted": node.interrupted,
            "variant": node.variant, "finish_reason": node.finish_reason, "stats": node.stats,
            "created": node.created}


def session_view(s: Session) -> dict:
    nodes = list(s.tree.nodes.values())
    return {"name": s.name, "model": s.model, "revision": s.revision, "head": s.head, "system": s.system,
            "settings": s.settings, "last_fork": s.last_fork, "updated": s.updated,
            "path": [n.id for n in s.path()], "roots": [n.id for n in s.tree.children(None)],
            "nodes": [node_view(n, s.tree) for n in nodes]}
