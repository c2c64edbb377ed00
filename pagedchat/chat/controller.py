"""The chat core with no terminal: sessions resident in one engine, turns, branches, variants, settings.

The REPL, `run --session` and the tests drive this class; it returns nodes and plain data, never prints. It
reaches the engine only through `self.backend` (chat/backend.py).
Every turn's prompt is the head's stored token ids plus the new message's rendered suffix, and it is
submitted with the pinned engine Branch that shares the longest prefix with it as `parent`, so only the
new tokens are prefilled (the prefix cache serves what a dropped pin no longer holds).
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field, replace
from datetime import datetime

from pagedchat.chat import alternatives
from pagedchat.chat.backend import ChatBackend, ContextFull  # noqa: F401  (ContextFull: raised from here)
from pagedchat.chat.session import Session, check_name
from pagedchat.chat.store import SaveError, SessionStore
from pagedchat.chat.tree import Node
from pagedchat.chat.turns import Templater, TextOnlyTemplater
from pagedchat.settings import MAX_FORK_VARIANTS, OVERFLOW_POLICIES, SamplingOptions, check_overflow, resolve_sampling
from pagedchat.engine.core.sampling_params import SETTING_KEYS, SETTING_TYPES
from pagedchat.errors import UserError
from pagedchat.prompts import require_text
from pagedchat.words import article

SET_KEYS = SETTING_KEYS     # /set takes exactly the sampling settings SamplingParams declares (and speculate, schema)
FORK_TEMPERATURE = 0.8      # /fork and /regen at temperature 0 would only repeat the greedy reply
MAX_FORK = MAX_FORK_VARIANTS
CHAT_KEYS = {"context_overflow": OVERFLOW_POLICIES}   # /set keys of the chat itself, not of sampling
ALL_SET_KEYS = (*SET_KEYS, *CHAT_KEYS)
THINK_MODES = ("show", "hide", "off")
CONTEXT_LEAD = 64           # prompt tokens put before a sibling reply, so a draft can match its start


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
        self.cli = cli or SamplingOptions()
        self.cli_system = system
        if self.backend.tokenizer is None and self.backend.describe() is not None:
            self.templater = TextOnlyTemplater()    # a server's model with no local tokenizer: text only
        else:
            self.templater = Templater(self.backend.tokenizer, self.backend.eos_token_ids,
                                       entry.table.get("chat_template_kwargs"), model=entry.name)
        self.sessions: dict[str, Session] = {}      # resident: all share the engine's pool
        self.current: Session | None = None
        self.last_stats: dict | None = None
        self.beam_width = 0                         # set while a /beam turn runs
        self.cli_overflow = check_overflow(context_overflow, "--context-overflow")
        self.overflow_default = overflow_default    # the REPL drops the oldest turns; `run --session` stops
        self.on_note = None     # called with notes known before a reply starts (else they come in TurnResult)
        self.schema: tuple[str, object] | None = None   # (/set schema FILE, its GrammarSpec): replies follow it

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
        path = self.store.save(session)
        self.backend.persist(list(session.handles.values()))
        return path

    def autosave(self) -> str | None:
        """Save after a change that is not a turn (head moved, settings); the error line if it failed."""
        if self.current is None or not (self.current.tree.nodes or self.store.exists(self.current.name)):
            return None  # nothing worth a file yet
        try:
            self.store.save(self.current)
        except SaveError as e:
            return str(e)
        return None

    # -- settings -------------------------------------------------------------------------------------------
    def sampling(self, n: int = 1):
        """(SamplingParams, sources) for the current session: CLI > /set > session > model > defaults."""
        s = self.session
        set_now = {k: v for k, v in s.settings.items() if k in s.set_keys and k in SET_KEYS}
        from_file = {k: v for k, v in s.settings.items() if k not in s.set_keys and k in SET_KEYS}
        params, sources = resolve_sampling(self.entry, self.cli, {**set_now, "__source__": "/set"},
                                           {**from_file, "__source__": f"session {s.name}"})
        return params.with_(n=n), sources

    def set_option(self, key: str, value: str) -> str:
        """`/set KEY VALUE`: validated like SamplingParams; `default` removes the override."""
        if key == "speculate":  # an engine setting, not a sampling one: it applies from the next turn
            self.backend.set_speculation(value.strip().lower())
            return f"speculate = {value.strip().lower()}"
        if key == "schema":     # a grammar for the replies, not a sampling setting
            return self._set_schema(value.strip())
        if key in CHAT_KEYS:
            return self._set_chat_option(key, value)
        if key not in SET_KEYS:
            raise UserError(f"unknown setting {key!r}; keys: {', '.join(ALL_SET_KEYS)}, speculate, schema")
        s = self.session
        keys = s.set_keys
        if value.strip().lower() == "default":
            s.settings.pop(key, None)
            keys.discard(key)
            params, sources = self.sampling()
            return f"{key} = {_show(getattr(params, key))} (from {sources.get(key, 'built-in default')})"
        parsed = _parse_value(key, value)
        trial = dict(s.settings, **{key: parsed})
        resolve_sampling(self.entry, SamplingOptions(), trial)  # raises the SamplingParams message if invalid
        s.settings[key] = parsed
        keys.add(key)
        message = f"{key} = {_show(parsed)}"
        if key in self.cli.given():
            message += f" (but --{key.replace('_', '-')} {_show(self.cli.given()[key])} on the command line wins)"
        return message

    def _set_chat_option(self, key: str, value: str) -> str:
        s = self.session
        value = value.strip().lower()
        if value == "default":
            s.settings.pop(key, None)
        else:
            s.settings[key] = check_overflow(value, key)
        policy, source = self.overflow_policy()
        message = f"{key} = {policy}" + (f" (from {source})" if value == "default" else "")
        if self.cli_overflow is not None and value != "default":
            message += f" (but --context-overflow {self.cli_overflow} on the command line wins)"
        return message

    def overflow_policy(self) -> tuple[str, str]:
        """(policy, where it came from) for a branch that outgrows the context: CLI > /set or session >
        models.toml > this front end's default."""
        if self.cli_overflow is not None:
            return self.cli_overflow, "command-line flag"
        if "context_overflow" in self.session.settings:
            return self.session.settings["context_overflow"], f"session {self.session.name}"
        entry = self.entry.get("context_overflow")
        if entry.value is not None:
            return check_overflow(entry.value, f"context_overflow in {entry.source}"), entry.source
        return self.overflow_default, "default"

    def think_mode(self) -> str:
        """/think: show (reasoning in full), hide (collapsed to one line once done; the default) or off (the
        template is asked not to think, where it takes enable_thinking)."""
        return self.session.settings.get("think", "hide")

    def set_think(self, mode: str) -> str:
        if mode not in THINK_MODES:
            raise UserError(f"usage: /think {'|'.join(THINK_MODES)}")
        self.session.settings["think"] = mode
        self._apply_think()
        if mode == "off" and not self.templater.takes("enable_thinking"):
            return ("think off: this model's template has no enable_thinking switch, so replies may still "
                    "reason; their reasoning is collapsed")
        return {"show": "reasoning is shown in full", "hide": "reasoning is collapsed to one line once done",
                "off": "the template is asked not to think (enable_thinking false)"}[mode]

    def _apply_think(self) -> None:
        """off passes enable_thinking=False to the template; show/hide leave the template its own default."""
        if self.think_mode() == "off":
            self.templater.kwargs["enable_thinking"] = False
        else:
            self.templater.kwargs.pop("enable_thinking", None)
            self.templater.kwargs.update(self.entry.table.get("chat_template_kwargs") or {})

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

    def _set_schema(self, path: str) -> str:
        """`/set schema FILE`: every reply is constrained to this JSON schema (checked now, so an unsupported
        one is refused here); `/set schema default` (or off) lifts it."""
        if path.lower() in ("default", "off"):
            self.schema = None
            return "schema off: replies are free text"
        from pagedchat.engine.core.grammar import GrammarSpec

        spec = GrammarSpec.from_schema_file(path)
        self.backend.check_grammar(spec)
        self.schema = (path, spec)
        return f"schema = {path}: every reply is JSON valid for it"

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

    # -- moving around --------------------------------------------------------------------------------------
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

    # -- turns ----------------------------------------------------------------------------------------------
    def send(self, text: str, n: int = 1, on_update=None) -> TurnResult:
        """A new user message after the head, answered with n variants."""
        require_text(text, "message")
        s = self.session
        head = s.head_node()
        if head is not None and head.role == "user":
            raise UserError(f"the head #{head.id} is a user message with no reply yet: /regen answers it, "
                            f"/switch moves elsewhere")
        path = self._path_with_system()
        params, notes = self._params(n)
        prompt, user_ids, context = self._fit(path, text, params, notes)
        out, interrupted, stats = self._generate(prompt, params, notes, on_update,
                                                 messages=_messages(path, text))
        if path and path[-1].id == 0:  # the system node of a conversation that starts now
            path[-1] = s.tree.add(None, "system", path[-1].text, path[-1].token_ids)
        user = s.tree.add(path[-1].id if path else None, "user", text, user_ids, context=context)
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
        params, notes = self._params(n, vary=True)
        prompt = s.tree.path_tokens(user.id)
        # earlier replies to the same message: n-gram drafts copy what a regeneration repeats of them
        context = [prompt[-CONTEXT_LEAD:] + reply.token_ids for reply in s.tree.children(user.id)]
        out, interrupted, stats = self._generate(prompt, params, notes, on_update, context,
                                                 messages=_messages(s.tree.path(user.id)))
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
        params, notes = self._params(1)
        prompt, user_ids, context = self._fit(path, text, params, notes)
        # the edited message's siblings and their replies: an edit's answer repeats much of the old one
        related = [sibling.token_ids + reply.token_ids for sibling in s.tree.children(node.parent)
                   for reply in s.tree.children(sibling.id)]
        out, interrupted, stats = self._generate(prompt, params, notes, on_update, related,
                                                 messages=_messages(path, text))
        user = s.tree.add(node.parent, "user", text, user_ids, context=context)
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
    def logprobs_on(self) -> bool:
        return bool(self.session.settings.get("logprobs", False))

    def set_logprobs(self, mode: str) -> str:
        """`/logprobs on|off`: replies from now on keep their tokens' alternatives (stored in the session)."""
        if mode not in ("on", "off"):
            raise UserError("usage: /logprobs on|off (/logprobs alone lists the head reply's alternatives)")
        if mode == "on" and self.backend.describe() is not None:
            raise UserError("/logprobs needs the local engine (the alternatives of each token): not available "
                            "with --server")
        self.session.settings["logprobs"] = mode == "on"
        if mode == "off":
            return "logprobs off: new replies keep no alternatives (stored ones stay)"
        return (f"logprobs on: each reply shows where the model hesitated, with up to "
                f"{alternatives.TOP_ALTERNATIVES - 1} alternatives; /branch INDEX ALT continues from one")

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
        params, notes = self._params(1)
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
    def _path_with_system(self):
        """The head's path; for a conversation that starts now, a system node (reused if one with the same
        text is already a root: all branches under it share its cached blocks). Node id 0 = not yet added."""
        s = self.session
        path = s.path()
        if path or not s.system:
            return path
        for root in s.tree.children(None):
            if root.role == "system" and root.text == s.system:
                return [root]
        return [Node(0, None, "system", s.system, self.templater.system_tokens(s.system))]

    def _fit(self, path: list[Node], text: str, params, notes: list[str]):
        """(prompt ids, the new user node's ids, its context record) for a new message after `path`.

        Under `stop` the branch keeps growing (the engine refuses it once it is full). Under `drop-oldest`,
        once the reply would have less room than it needs, the system prompt and the newest turns that fit in
        half the context are rendered afresh with the new message; the dropped turns are said in a note and
        recorded on the new node. Half, not all of it: each drop shifts every later position, so nothing
        after the system prompt can come from the cache; dropping well below the limit lets the next turns
        append to pinned KV again instead of re-rendering every turn."""
        s = self.session
        user_ids = self.templater.user_turn_tokens(path, text)
        history = s.tree.path_tokens(path[-1].id) if path and path[-1].id else [t for n in path for t in n.token_ids]
        prompt = history + user_ids
        max_len = self.backend.max_model_len
        limit = max_len - min(params.max_tokens, max(32, max_len // 4))   # room kept for the reply
        if not s.compact_next and (len(prompt) <= limit or self.overflow_policy()[0] == "stop"):
            return prompt, user_ids, None
        s.compact_next = False
        system = [path[0]] if path and path[0].role == "system" else []
        gone = {i for node in path if node.context for i in node.context["dropped"]}
        turns = [node for node in path[len(system):] if node.id not in gone]
        starts = [i for i, node in enumerate(turns) if node.role == "user"]
        for start in starts[1:] + [len(turns)]:        # drop the oldest turns first, one exchange at a time
            prefix, new_ids = self.templater.compacted_turn(system + turns[start:], text)
            if len(prefix) + len(new_ids) <= max_len // 2:
                break
        if len(prefix) + len(new_ids) >= max_len:
            raise ContextFull(f"the context is full: this message alone needs {len(prefix) + len(new_ids)} "
                              f"tokens and the model takes {max_len}", "send a shorter message")
        dropped = [node.id for node in turns[:start]]
        if not dropped:     # nothing older to drop: the message goes as it is (the engine says if it cannot)
            return prompt, user_ids, None
        notes.append(f"dropped turns #{dropped[0]}-#{dropped[-1]} from the context "
                     f"({len(prompt)} -> {len(prefix) + len(new_ids)} tokens)")
        return prefix + new_ids, new_ids, {"dropped": dropped, "prefix_ids": prefix}

    def _params(self, n: int, vary: bool = False):
        """Sampling for a turn. Variants (n > 1) and regenerations (vary) at temperature 0 would all be the
        same reply, so they sample at the model's own temperature (or FORK_TEMPERATURE) and say so."""
        self._apply_think()     # the current session's /think decides what the template is asked
        params, sources = self.sampling(n)
        params = params.with_(grammar=self.schema[1] if self.schema else None,
                              logprobs=alternatives.TOP_ALTERNATIVES if self.logprobs_on() else None)
        notes = []
        if self.beam_width:    # deterministic (no temperature to raise); hypotheses carry scores, not alternatives
            return params.with_(n=1, beam_width=self.beam_width, logprobs=None), notes
        if (n > 1 or vary) and params.temperature == 0:
            lower = self.entry.sampling_defaults().get("temperature")
            temperature = lower.value if lower is not None and lower.value else FORK_TEMPERATURE
            params = params.with_(temperature=float(temperature))
            what = f"the {n} variants would be identical" if n > 1 else "/regen would repeat the same reply"
            notes.append(f"temperature is 0, so {what}: sampling at temperature {temperature:g}")
        return params, notes

    def _generate(self, prompt: list[int], params, notes: list[str], on_update, context=None, messages=None):
        room = self.backend.max_model_len - len(prompt)
        # Under stop, leave room for more turns in a small context; drop-oldest makes room when it must.
        limit = room if self.overflow_policy()[0] == "drop-oldest" else max(room // 2, min(room, 32))
        capped = None
        if room >= 1 and params.max_tokens > limit:   # room < 1: the engine refuses it (ContextFull)
            params = params.with_(max_tokens=limit)
            capped = limit
        if self.on_note is not None:    # say it before the reply streams, not after
            for note in notes:
                self.on_note(note)
            notes.clear()
        parent = self.backend.pin_for(self.session.handles, prompt)
        done = self.backend.generate(prompt, params, parent, on_update, context, messages=messages)
        notes.extend(getattr(self.backend, "notes", ()))    # a remote fallback, said once
        getattr(self.backend, "notes", []).clear()
        stats = self._stats(prompt, done.output, capped, max(params.n, params.beam_width))
        return done.output, done.interrupted, stats

    def _stats(self, prompt: list[int], out, capped: int | None, n: int) -> dict:
        completion = sum(len(v.token_ids) for v in out.outputs)
        ttft, total = out.ttft_s, out.total_s
        decode_s = (total - ttft) if total is not None and ttft is not None else None
        decoded = completion - len(out.outputs)
        pool = self.backend.pool_stats()
        remote = self.backend.describe()
        size = len(prompt)
        if remote is not None and not prompt:   # text only (no local tokenizer): the server counted the prompt
            size = remote["prompt_tokens"] or 0
        return {"ttft_s": ttft, "total_s": total,
                "tokens_per_s": decoded / decode_s if decode_s and decoded > 0 else None,
                "completion_tokens": completion, "variants": len(out.outputs),
                "variants_requested": n,
                "prompt_tokens": size, "prompt_cached": out.prefix_hit_tokens,
                "prompt_new": size - out.prefix_hit_tokens,
                "context_tokens": size + max((len(v.token_ids) for v in out.outputs), default=0),
                "max_context": self.backend.max_model_len, "capped_max_tokens": capped,
                "blocks_used": pool.used, "num_blocks": pool.num_blocks, "block_size": pool.block_size,
                **({"remote": remote} if remote is not None else {})}

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
                               variant=variant.index + 1 if many else None, stats=_node_stats(stats),
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
        if stats["capped_max_tokens"] is not None and any(r.finish_reason == "length" for r in replies):
            result.notes.append(f"reply capped at {stats['capped_max_tokens']} tokens to leave room in the "
                                f"{stats['max_context']}-token context")
        try:
            self.store.save(s)
        except SaveError as e:
            result.save_error = str(e)
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
        st = self.backend.stats()
        pool = st.pool_stats
        per_session = {name: {"nodes": len(s.tree), "pinned_heads": sum(1 for h in s.handles.values() if h.is_pinned),
                              "blocks": self.backend.blocks_held(s.handles.values())}
                       for name, s in self.sessions.items()}
        return {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "kv_dtype": pool.kv_dtype,
                "used": pool.used, "free": pool.free,
                "cached": pool.cached, "shared": pool.shared, "peak_used": pool.peak_used,
                "prefix_hit_tokens": pool.prefix_hit_tokens, "prefix_query_tokens": pool.prefix_query_tokens,
                "prefix_hit_rate": pool.prefix_hit_rate, "cow_copies": pool.cow_copies, "pinned": st.pinned,
                "ram_hit_tokens": pool.ram_hit_tokens, "disk_hit_tokens": pool.disk_hit_tokens,
                "pinned_blocks": st.pinned_blocks, "preemptions": st.preemptions, "sessions": per_session,
                "last_turn": self.last_stats, "spec": st.spec,
                **({"remote": remote} if (remote := self.backend.describe()) is not None else {})}


def _messages(path: list[Node], text: str | None = None) -> list[dict]:
    """The turn as chat messages (what a server without token-id prompts gets): the path's texts, then the
    new user message."""
    out = [{"role": n.role, "content": n.text} for n in path]
    return out + [{"role": "user", "content": text}] if text is not None else out


def _node_stats(stats: dict) -> dict:
    keys = ("ttft_s", "tokens_per_s", "prompt_new", "prompt_cached", "completion_tokens", "blocks_used")
    return {k: stats[k] for k in keys}


def _parse_value(key: str, value: str):
    kind = SETTING_TYPES[key]
    value = value.strip()
    if kind is list:
        if value.lower() == "none":
            return []
        if value.startswith("["):
            try:
                items = json.loads(value)
            except ValueError:
                raise UserError('stop: give one string, or a JSON list like ["\\n\\n", "User:"]') from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise UserError("stop: the JSON list must hold strings")
            return items
        return [codecs.decode(value, "unicode_escape") if "\\" in value and value.isascii() else value]
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (list, str)) else str(value)
