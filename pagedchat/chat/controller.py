"""The chat core with no terminal: the sessions resident in one engine, and the turns of the current one.

The REPL, `run --session` and the tests drive this class; it returns nodes and plain data, never prints. It
reaches the engine only through `self.backend` (chat/backend.py). What it delegates:
    options.py   settings and their sources (/set, /think, /logprobs, schema, context overflow)
    context.py   a turn's prompt ids fitted into the context window (drop-oldest), or its chat messages
    stats.py     a turn's stats and the /stats pool report
Every turn's prompt is the head's stored token ids plus the new message's rendered suffix, and it is
submitted with the pinned engine Branch that shares the longest prefix with it as `parent`, so only the
new tokens are prefilled (the prefix cache serves what a dropped pin no longer holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

from pagedchat.chat import alternatives
from pagedchat.chat.context import CONTEXT_LEAD, as_messages, fit, path_with_system, reply_cap
from pagedchat.chat.stats import node_stats, pool_report, turn_stats
from pagedchat.chat.backend import ChatBackend
from pagedchat.chat.options import ChatOptions
from pagedchat.chat.session import Session, check_name, rebase
from pagedchat.chat.store import SaveError, SessionStore, StaleSession
from pagedchat.chat.tree import Node
from pagedchat.chat.turns import Templater, TextOnlyTemplater
from pagedchat.errors import UserError
from pagedchat.prompts import require_text
from pagedchat.settings import MAX_FORK_VARIANTS, SamplingOptions
from pagedchat.words import article

MAX_FORK = MAX_FORK_VARIANTS


@dataclass
class TurnResult:
    user: Node | None                 # the new user message (None for /regen and /fork without text)
    replies: list[Node]               # one per variant
    stats: dict
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    save_error: str | None = None


class ChatController:
    def __init__(self, engine, entry, store: SessionStore | None = None, cli: SamplingOptions | None = None,
                 system: str | None = None, context_overflow: str | None = None,
                 overflow_default: str = "stop", backend=None):
        self.engine, self.entry = engine, entry     # the engine is used through self.backend only
        # backend: ChatBackend on the local engine, or RemoteBackend (--server; engine is None then)
        self.backend = backend or ChatBackend(engine)
        self.store = store or SessionStore()
        self.cli_system = system
        if self.backend.tokenizer is None and self.backend.describe() is not None:
            self.templater = TextOnlyTemplater()    # a server's model with no local tokenizer: text only
        else:
            self.templater = Templater(self.backend.tokenizer, self.backend.eos_token_ids,
                                       entry.table.get("chat_template_kwargs"), model=entry.name)
        self.options = ChatOptions(entry, self.backend, self.templater, cli, context_overflow, overflow_default)
        self.cli = self.options.cli                 # the sampling flags (tests change them between turns)
        self.sessions: dict[str, Session] = {}      # resident: all share the engine's pool
        self.current: Session | None = None
        self.last_stats: dict | None = None
        self.beam_width = 0                         # set while a /beam turn runs
        self.on_note = None     # called with notes known before a reply starts (else they come in TurnResult)

    @property
    def session(self) -> Session:
        assert self.current is not None, "no current session"
        return self.current

    @property
    def default_system(self) -> str | None:
        if self.cli_system is not None:
            return self.cli_system or None
        return self.entry.get("system_prompt").value or None

    # -- sessions -------------------------------------------------------------------------------------------
    def new_session(self, name: str | None = None) -> Session:
        if name is None:
            stem = datetime.now().strftime("chat-%Y%m%d-%H%M%S")
            name, n = stem, 2
            while name in self.sessions or self.store.exists(name):
                name, n = f"{stem}-{n}", n + 1
        check_name(name)
        if name in self.sessions or self.store.exists(name):
            raise UserError(f"a session named {name!r} already exists: /open {name}")
        session = Session(name, model=self.entry.name, model_path=str(self.entry.path),
                          fingerprint=self.templater.fingerprint(), system=self.default_system)
        self.sessions[name] = self.current = session
        return session

    def open_session(self, name: str, create: bool = False) -> tuple[Session, bool]:
        """Make NAME current: resident, else loaded from disk, else (create=True) new. Returns (session, new)."""
        check_name(name)
        if name in self.sessions:
            self.current = self.sessions[name]
            return self.current, False
        if not self.store.exists(name):
            if create:
                return self.new_session(name), True
            raise UserError(f"no session named {name!r} (see /sessions)")
        session = self.store.load(name)
        self.check_model(session)
        self.sessions[name] = self.current = session
        return session, False

    def check_model(self, session: Session) -> None:
        same = session.model in (self.entry.name, str(self.entry.path)) or session.model_path == str(self.entry.path)
        if session.model and not same:
            raise UserError(f"session {session.name} was recorded with model {session.model!r}, not "
                            f"{self.entry.name!r}: its token ids only mean something to that model "
                            f"(use -m {session.model})")
        vocab, mine = session.fingerprint.get("vocab_size"), self.templater.fingerprint().get("vocab_size")
        if vocab is not None and mine is not None and vocab != mine:
            raise UserError(f"session {session.name} was recorded with a tokenizer of {vocab} tokens; this "
                            f"model's has {mine}")
        if session.fingerprint.get("history") == "text" and mine is not None:
            raise UserError(f"session {session.name} was recorded as text only (a server whose model had no local "
                            f"tokenizer): it has no token ids to continue from; continue it the same way (--server)")

    def save(self, as_name: str | None = None):
        session = self.session
        if as_name is not None and as_name != session.name:
            check_name(as_name)
            if as_name in self.sessions or self.store.exists(as_name):
                raise UserError(f"a session named {as_name!r} already exists")
            del self.sessions[session.name]
            session.name = as_name
            self.sessions[as_name] = session
        self.save_or_rebase(session)
        self.backend.persist(list(session.handles.values()))
        return self.store.path(session.name)

    def autosave(self) -> str | None:
        """Save after a change that is not a turn (head moved, settings): the line to show, if any (why it failed,
        or that another window had saved the session meanwhile)."""
        if self.current is None or not (self.current.tree.nodes or self.store.exists(self.current.name)):
            return None  # nothing worth a file yet
        try:
            return rebased_note(self.current, self.save_or_rebase(self.current))
        except SaveError as e:
            return str(e)

    def save_or_rebase(self, s: Session) -> dict[int, int] | None:
        """Save s. When another writer (a browser tab, another REPL) saved it meanwhile, reload its copy and
        add what s has new on top (session.rebase): nothing of either is lost. Returns None, or when it rebased
        the new ids of the nodes it moved."""
        try:
            self.store.save(s)
            return None
        except StaleSession:
            saved = self.store.load(s.name)
            try:
                moved = rebase(s, saved)
            except ValueError as e:
                raise SaveError(f"session {s.name} was changed elsewhere and no longer holds this branch ({e}); "
                                f"nothing was saved: /save NEW_NAME keeps this copy") from None
            self.store.save(s)
            return moved

    # -- settings of the current session (chat/options.py) ---------------------------------------------------
    @property
    def schema(self):
        return self.options.schema

    def sampling(self, n: int = 1):
        return self.options.sampling(self.session, n)

    def set_option(self, key: str, value: str) -> str:
        return self.options.set_option(self.session, key, value)

    def overflow_policy(self) -> tuple[str, str]:
        return self.options.overflow_policy(self.session)

    def think_mode(self) -> str:
        return self.options.think_mode(self.session)

    def set_think(self, mode: str) -> str:
        return self.options.set_think(self.session, mode)

    def logprobs_on(self) -> bool:
        return self.options.logprobs_on(self.session)

    def set_logprobs(self, mode: str) -> str:
        return self.options.set_logprobs(self.session, mode)

    # -- the branch: where the next message goes ----------------------------------------------------------
    def switch(self, node_id: int) -> Node:
        node = self.session.node(node_id)
        self.session.head = node.id
        return node

    def pick(self, k: int) -> Node:
        s = self.session
        if not s.last_fork:
            raise UserError("no variants to pick from: /fork N or /beam W first")
        if not 1 <= k <= len(s.last_fork):
            raise UserError(f"pick a variant from 1 to {len(s.last_fork)}")
        s.head = s.last_fork[k - 1]
        return s.tree.get(s.head)

    def set_system(self, text: str | None) -> str:
        """A new system prompt starts a new branch from the top (the old conversation stays in the tree)."""
        s = self.session
        had_messages = any(n.role != "system" for n in s.path())
        s.system = text or None
        s.head = None
        what = "system prompt cleared" if not text else "system prompt set"
        if had_messages:
            return f"{what}; the next message starts a new branch from the top (the old one stays: /tree)"
        return what

    def clear(self) -> None:
        """Start over from the top of the tree; nothing is deleted."""
        self.session.head = None

    def compact(self) -> str:
        """`/compact`: the next message drops the oldest turns of this branch now, not when it must."""
        s = self.session
        turns = sum(1 for n in s.path() if n.role == "user")
        if turns < 2:
            raise UserError("nothing to compact: the branch holds at most one exchange")
        s.compact_next = True
        return (f"the next message drops the oldest turns (at least one exchange; they stay in /tree) until the "
                f"rest fits in half the context (the branch holds {len(s.tree.path_tokens(s.head))} of "
                f"{self.backend.max_model_len} tokens)")

    # -- turns ----------------------------------------------------------------------------------------------
    def send(self, text: str, n: int = 1, on_update=None) -> TurnResult:
        """A new user message after the head, answered with n variants."""
        require_text(text, "message")
        s = self.session
        head = s.head_node()
        if head is not None and head.role == "user":
            raise UserError(f"the head #{head.id} is a user message with no reply yet: /regen answers it, "
                            f"/switch moves elsewhere")
        path = path_with_system(s, self.templater)
        params, notes = self.options.turn_params(s, n, beam_width=self.beam_width)
        prompt, user_ids, dropped = self._fit(path, text, params, notes)
        out, interrupted, stats = self._generate(prompt, params, notes, on_update,
                                                 messages=as_messages(path, text))
        if path and path[-1].id == 0:  # the system node of a conversation that starts now
            path[-1] = s.tree.add(None, "system", path[-1].text, path[-1].token_ids)
        user = s.tree.add(path[-1].id if path else None, "user", text, user_ids, context=dropped)
        return self._finish(user, out, interrupted, stats, notes, user_node=user)

    def regen(self, n: int = 1, on_update=None) -> TurnResult:
        """A new reply (or n variants) to the user message behind the head; the old reply stays."""
        s = self.session
        head = s.head_node()
        user = head if head is not None and head.role == "user" else None
        if head is not None and head.role == "assistant":
            user = s.tree.get(head.parent)
        if user is None:
            raise UserError("nothing to regenerate yet: send a message first")
        params, notes = self.options.turn_params(s, n, vary=True, beam_width=self.beam_width)
        prompt = s.tree.path_tokens(user.id)
        # earlier replies to the same message: n-gram drafts copy what a regeneration repeats of them
        related = [prompt[-CONTEXT_LEAD:] + reply.token_ids for reply in s.tree.children(user.id)]
        out, interrupted, stats = self._generate(prompt, params, notes, on_update, related,
                                                 messages=as_messages(s.tree.path(user.id)))
        return self._finish(user, out, interrupted, stats, notes, user_node=None)

    def edit(self, node_id: int, text: str, on_update=None) -> TurnResult:
        """Replace an earlier user message in a new sibling branch and answer it."""
        s = self.session
        node = s.node(node_id)
        if node.role != "user":
            raise UserError(f"#{node_id} is {article(node.role)} message; /edit changes user messages "
                            f"(/regen for replies, /system for the system prompt)")
        require_text(text, "edited message")
        path = s.tree.path(node.parent)
        params, notes = self.options.turn_params(s, 1, beam_width=self.beam_width)
        prompt, user_ids, dropped = self._fit(path, text, params, notes)
        # the edited message's siblings and their replies: an edit's answer repeats much of the old one
        related = [sibling.token_ids + reply.token_ids for sibling in s.tree.children(node.parent)
                   for reply in s.tree.children(sibling.id)]
        out, interrupted, stats = self._generate(prompt, params, notes, on_update, related,
                                                 messages=as_messages(path, text))
        user = s.tree.add(node.parent, "user", text, user_ids, context=dropped)
        return self._finish(user, out, interrupted, stats, notes, user_node=user)

    def fork(self, n: int, text: str | None = None, on_update=None) -> TurnResult:
        """N variants in parallel, forks of one sequence: of a new message, else of the head's reply."""
        if not 1 <= n <= MAX_FORK:
            raise UserError(f"/fork takes a number of variants from 1 to {MAX_FORK}, got {n}")
        if text:
            return self.send(text, n, on_update)
        head = self.session.head_node()
        if head is None or head.role == "system":
            raise UserError("nothing to fork yet: /fork N MESSAGE sends MESSAGE and answers it N ways")
        return self.regen(n, on_update)

    def beam(self, width: int, text: str | None = None, on_update=None) -> TurnResult:
        """Beam search with W beams: the W hypotheses, best first, as variants (of a new message, else of
        the head's reply); /pick K continues from one."""
        if not 1 <= width <= MAX_FORK:
            raise UserError(f"/beam takes a number of beams from 1 to {MAX_FORK}, got {width}")
        self.beam_width = width
        try:
            return self.fork(1, text, on_update)
        finally:
            self.beam_width = 0

    # -- token alternatives ---------------------------------------------------------------------------------
    def branch(self, index: int, word: str, on_update=None) -> TurnResult:
        """`/branch I ALT`: a sibling of the head reply that keeps its first I tokens, has ALT at position I
        and is generated on from there (the shared prefix is the pinned reply's KV: one token of prefill)."""
        s = self.session
        reply = s.head_node()
        if reply is None or reply.role != "assistant":
            raise UserError("/branch starts from a reply: the head is not one (/switch ID to a reply first)")
        if not 0 <= index < len(reply.token_ids):
            raise UserError(f"token index {index} is outside reply #{reply.id} (0-{len(reply.token_ids) - 1}; "
                            f"/logprobs lists them)")
        row = reply.logprobs[index] if reply.logprobs else None
        token = alternatives.choose(word, row, reply.token_ids[index], self.templater.decode, self.templater.encode)
        if token == reply.token_ids[index]:
            raise UserError(f"token {index} of #{reply.id} already is {self.templater.decode([token])!r}: "
                            f"name another")
        user = s.tree.get(reply.parent)
        start = reply.token_ids[:index] + [token]
        start_text = self.templater.decode(start)
        known = [lp for t, lp in row[1] if t == token] if row else []
        rows = reply.logprobs[:index] + [[known[0], row[1]]] if known and self.logprobs_on() else None
        if token in self.templater.end_ids:     # the alternative ends the reply: nothing left to generate
            return self._add_reply(user, start_text, start, rows)
        params, notes = self.options.turn_params(s, 1, beam_width=self.beam_width)
        params = params.with_(max_tokens=max(1, params.max_tokens - len(start)))
        prompt = s.tree.path_tokens(user.id) + start
        related = [prompt[-CONTEXT_LEAD - len(start):-len(start)] + reply.token_ids]
        shown = (lambda i, text: on_update(i, start_text + text)) if on_update is not None else None
        out, interrupted, stats = self._generate(prompt, params, notes, shown, related)
        out.outputs = [replace(v, token_ids=start + v.token_ids, text=start_text + v.text) for v in out.outputs]
        return self._finish(user, out, interrupted, stats, notes, user_node=None, logprob_prefix=rows)

    def _add_reply(self, user: Node, text: str, token_ids: list[int], rows) -> TurnResult:
        s = self.session
        reply = s.tree.add(user.id, "assistant", text, token_ids, finish_reason="stop", logprobs=rows)
        s.head = reply.id
        result = TurnResult(None, [reply], {"completion_tokens": 0})
        result.save_error = self.autosave()
        return result

    # -- internals ------------------------------------------------------------------------------------------
    def _fit(self, path: list[Node], text: str, params, notes: list[str]):
        """(prompt ids, the new user node's ids, what it dropped from the context): chat/context.py `fit`."""
        return fit(self.session, self.templater, path, text, params.max_tokens, self.backend.max_model_len,
                   self.overflow_policy()[0], notes)

    def _generate(self, prompt: list[int], params, notes: list[str], on_update, related=None, messages=None):
        """Run the turn's request on the backend; (output, interrupted, stats). `related`: token streams the
        reply may repeat (n-gram drafts copy from them)."""
        capped = reply_cap(len(prompt), params.max_tokens, self.backend.max_model_len, self.overflow_policy()[0])
        if capped is not None:
            params = params.with_(max_tokens=capped)
        if self.on_note is not None:    # say it before the reply streams, not after
            for note in notes:
                self.on_note(note)
            notes.clear()
        parent = self.backend.pin_for(self.session.handles, prompt)
        done = self.backend.generate(prompt, params, parent, on_update, related, messages=messages)
        notes.extend(getattr(self.backend, "notes", ()))    # a remote fallback, said once
        getattr(self.backend, "notes", []).clear()
        stats = turn_stats(self.backend, prompt, done.output, capped, max(params.n, params.beam_width))
        return done.output, done.interrupted, stats

    def _finish(self, parent: Node, out, interrupted: bool, stats: dict, notes: list[str], user_node,
                logprob_prefix: list | None = None) -> TurnResult:
        """logprob_prefix: the stored rows of the tokens a /branch reply starts with (its own follow)."""
        s = self.session
        replies = []
        many = stats["variants_requested"] > 1
        for variant in out.outputs:
            rows = None
            if variant.logprobs is not None:   # kept only whole: one row per token of the reply
                rows = (logprob_prefix or []) + alternatives.compact(variant.logprobs)
                rows = rows if len(rows) == len(variant.token_ids) else None
            reply = s.tree.add(parent.id, "assistant", variant.text, variant.token_ids,
                               interrupted=interrupted or variant.finish_reason == "abort",
                               finish_reason="interrupted" if interrupted else variant.finish_reason,
                               variant=variant.index + 1 if many else None, stats=node_stats(stats),
                               logprobs=rows)
            if variant.handle is not None:
                s.handles[reply.id] = variant.handle
            replies.append(reply)
        self._release_covered_pins(parent.id)
        if any(v.score is not None for v in out.outputs):
            notes.append("beam scores, best first: " + ", ".join(f"{v.index + 1}: {v.score:.4f}" for v in out.outputs))
        if len(replies) > 1:
            s.last_fork = [r.id for r in replies]  # /pick refers to the newest /fork until the next one
        s.head = replies[0].id if replies else parent.id
        self.last_stats = stats
        result = TurnResult(user_node, replies, stats, interrupted, notes)
        if len(replies) > 1 and len({r.text for r in replies}) == 1 and not interrupted and not self.beam_width:
            result.notes.append(f"the {len(replies)} variants came out identical: the model is nearly certain of "
                                f"every token of this reply (a higher temperature, /set temperature, varies it)")
        if stats["capped_max_tokens"] is not None and any(r.finish_reason == "length" for r in replies):
            result.notes.append(f"reply capped at {stats['capped_max_tokens']} tokens to leave room in the "
                                f"{stats['max_context']}-token context")
        try:
            moved = self.save_or_rebase(s)
        except SaveError as e:
            result.save_error = str(e)
        else:
            if moved is not None:
                result.notes.append(rebased_note(s, moved))
                result.user = s.tree.get(moved.get(user_node.id, user_node.id)) if user_node is not None else None
                result.replies = [s.tree.get(moved.get(r.id, r.id)) for r in replies]
        # Write the branch heads' full blocks through to the disk tier: reopening this session in another
        # process loads them instead of prefilling the whole history again.
        self.backend.persist(list(s.handles.values()))
        return result

    def _release_covered_pins(self, node_id: int) -> None:
        """Pins on the path above a new reply are covered by the reply's own pin: drop them."""
        s = self.session
        for node in s.tree.path(node_id):
            handle = s.handles.pop(node.id, None)
            if handle is not None:
                self.backend.release(handle)

    # -- pool ------------------------------------------------------------------------------------------------
    def pool_stats(self) -> dict:
        return pool_report(self.backend, self.sessions, self.last_stats)


def rebased_note(s: Session, moved: dict | None) -> str | None:
    if moved is None:
        return None
    return (f"session {s.name} was changed in another window meanwhile: reloaded it ({len(s.tree)} nodes) and "
            f"added this change to it")
