"""ChatBackend's twin for `--server URL`: the same narrow interface (generate, pins, numbers), with an
OpenAI-compatible server doing the generation. The controller, the REPL and `run --session` do not know
which one they hold, so the conversation tree, sessions, /regen, /edit, /fork N (the request's `n`), stop
strings and sampling settings work unchanged.

What stays local: the tree, the sessions, the chat template and the tokenizer. Each turn's prompt is the
same token ids the local engine would get (the path's stored ids + the rendered new message), sent to
/v1/completions as a token-id prompt, so the server's prefix cache sees an identical prefix every turn
and the reply's ids (`return_token_ids`, vLLM's field) go into the tree: the history stays token-exact and
a session moves between the local engine and a server either way. A server that refuses token-id
prompts, or a model with no local tokenizer, gets /v1/chat/completions with messages instead; the
history is then text-exact (replies re-encoded locally, or no ids at all), and /stats and --json say so.
"""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

from pagedchat.chat.backend import Generated
from pagedchat.engine import CompletionOutput, PoolStats, RequestOutput
from pagedchat.engine.outputs import EngineStats
from pagedchat.errors import UserError
from pagedchat.remote import RemoteError, Server

COMPLETIONS, CHAT = "/completions", "/chat/completions"
UNKNOWN_CONTEXT = 1 << 20   # neither the server nor a local config says: the server refuses what is too long


class RemoteBackend:
    # Ctrl-C raises KeyboardInterrupt here (stop_on_ctrl_c leaves SIGINT alone): a socket read waiting for a
    # stalled server ends at once, and generate() keeps what had arrived as the interrupted reply.
    raises_on_ctrl_c = True

    def __init__(self, server: Server, model: str, tokenizer, eos_token_ids, max_model_len: int,
                 model_path: str = ""):
        self.server, self.model = server, model
        self.tokenizer, self.eos_token_ids = tokenizer, set(eos_token_ids)
        self.model_path = model_path    # the local folder of the tokenizer (prompts.render_chat names it)
        self.max_model_len = max_model_len
        self.endpoint = COMPLETIONS if tokenizer is not None else CHAT
        self.ask_ids = True             # send return_token_ids until a server refuses the field
        self.replies_exact = True       # every reply so far came with the server's own token ids
        self.cached_total = 0           # prompt tokens the server reported served from its prefix cache
        self.prompt_total = 0
        self.last_usage: dict | None = None
        self.notes: list[str] = []      # what changed on the way (a fallback), said once by the front end
        self.stop_requested = False

    # -- what the front ends show ---------------------------------------------------------------------------
    def describe(self) -> dict:
        """The remote side of /stats, the stats line and --json."""
        exact = self.endpoint == COMPLETIONS and self.replies_exact
        usage = self.last_usage or {}
        return {"server": self.server.url, "model": self.model, "endpoint": "/v1" + self.endpoint,
                "history": "token-exact" if exact else "text-exact",
                "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": usage.get("cached_tokens"),
                "cached_tokens_total": self.cached_total, "prompt_tokens_total": self.prompt_total}

    def encode(self, text: str) -> list[int]:
        """`run --raw`: the prompt as the local engine would encode it."""
        if self.tokenizer is None:
            raise UserError(f"--raw needs a local tokenizer for model {self.model!r}: give -m MODEL_FOLDER")
        return list(self.tokenizer(text).input_ids)

    def check_grammar(self, spec) -> None:
        raise UserError("/set schema needs the local engine's grammar support: not available with --server")

    def set_speculation(self, method: str) -> None:
        raise UserError("speculate is a setting of the local engine: with --server, the server decides")

    def stop(self) -> None:
        self.stop_requested = True

    # -- a turn ---------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], params, parent, on_update, context=None,
                 messages: list[dict] | None = None) -> Generated:
        """One prompt (n variants) streamed from the server; on_update(index, text so far). A server error or
        a dropped stream raises RemoteError (nothing of the turn is kept); Ctrl-C keeps the partial replies."""
        start = time.perf_counter()
        try:
            replies, usage, first_at, interrupted = self._stream(prompt, params, on_update, messages)
        except RemoteError as e:
            if not e.refused_prompt or self.endpoint == CHAT:
                raise
            self.endpoint = CHAT        # a server that takes no token-id prompts: messages from now on
            self.notes.append(f"the server refused a token-id prompt ({e}); using /v1/chat/completions: the "
                              f"history is text-exact from here")
            replies, usage, first_at, interrupted = self._stream(prompt, params, on_update, messages)
        total = time.perf_counter() - start
        outputs = [self._output(i, replies.get(i, _Reply()), interrupted)
                   for i in range(max(params.n, params.beam_width))]
        cached = usage.get("cached_tokens")
        self.last_usage = usage
        self.cached_total += cached or 0
        self.prompt_total += usage.get("prompt_tokens") or len(prompt)
        out = RequestOutput("remote", list(prompt), outputs, not interrupted, cached or 0,
                            (first_at - start) if first_at else None, total)
        return Generated(out, interrupted)

    def _stream(self, prompt, params, on_update, messages):
        """(replies by index, usage, time of the first token, interrupted) of one streamed request."""
        body = self._body(prompt, params, messages)
        replies: dict[int, _Reply] = {}
        usage: dict = {}
        first_at, interrupted = None, False
        self.stop_requested = False
        try:
            with closing(self.server.stream(self.endpoint, body)) as chunks:
                for chunk in chunks:
                    usage = _usage(chunk.get("usage")) or usage
                    for choice in chunk.get("choices") or []:
                        reply = replies.setdefault(int(choice.get("index", 0)), _Reply())
                        text = _choice_text(choice)
                        if reply.add(text, choice.get("token_ids"), choice.get("finish_reason")):
                            first_at = first_at or time.perf_counter()
                        if text and on_update is not None:
                            on_update(int(choice.get("index", 0)), reply.text)
                    if self.stop_requested:
                        interrupted = True
                        break
        except KeyboardInterrupt:
            interrupted = True              # leaving the `with` closed the connection: the server aborts
        except RemoteError as e:
            if self.ask_ids and e.status in (400, 422) and "return_token_ids" in str(e):
                self.ask_ids = False        # a strict server that does not know vLLM's field: ask once without
                return self._stream(prompt, params, on_update, messages)
            raise
        return replies, usage, first_at, interrupted

    def _body(self, prompt: list[int], params, messages) -> dict:
        body = {"model": self.model, "max_tokens": params.max_tokens, "n": params.n,
                "temperature": params.temperature, "stream_options": {"include_usage": True}}
        # only what differs from "off": a strict server (OpenAI's own) refuses the extension fields
        for key, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0), ("seed", None)):
            if getattr(params, key) != off:
                body[key] = getattr(params, key)
        if params.stop:
            body["stop"] = list(params.stop)
        if params.beam_width:   # /beam W: vLLM's (and pagedchat serve's) fields; all W hypotheses come back
            body.update(use_beam_search=True, n=params.beam_width, best_of=params.beam_width,
                        length_penalty=params.length_penalty, early_stopping=params.early_stopping)
        if self.ask_ids:
            body["return_token_ids"] = True
        if self.endpoint == COMPLETIONS:
            body["prompt"] = list(prompt)
        else:
            if messages is None:
                raise UserError("this turn has no messages to send to /v1/chat/completions")
            body["messages"] = messages
        return body

    def _output(self, index: int, reply: "_Reply", interrupted: bool) -> CompletionOutput:
        ids = reply.ids
        if ids is None:     # the server sent no ids: the local tokenizer's reading of the text (text-exact)
            self.replies_exact = False
            ids = list(self.tokenizer(reply.text, add_special_tokens=False).input_ids) \
                if self.tokenizer is not None and reply.text else []
        finish = "abort" if interrupted and reply.finish is None else reply.finish
        return CompletionOutput(index, ids, reply.text, finish)

    # -- branch pins: the server's prefix cache does this job, so there is nothing to hold here ----------------
    def pin_for(self, handles, prompt):
        return None

    def release(self, handle) -> None:
        pass

    def blocks_held(self, handles) -> int:
        return 0

    def persist(self, handles) -> None:
        pass                # the server keeps (and tiers) its own KV: nothing to write here

    def close(self) -> None:
        pass

    # -- numbers --------------------------------------------------------------------------------------------
    def pool_stats(self) -> PoolStats:
        """No local pool: zeros, with the server's cached prompt tokens as the prefix hits."""
        return PoolStats(0, 0, 0, 0, 0, 0, 0, self.cached_total, self.prompt_total, 0)

    def stats(self) -> EngineStats:
        return EngineStats(self.pool_stats(), 0, 0, 0, 0, 0, None)


class _Reply:
    """One variant as it streams in: text, token ids (None until the server sends some), finish reason."""

    def __init__(self):
        self.text, self.ids, self.finish = "", None, None

    def add(self, text: str, ids, finish) -> bool:
        """Add a chunk's part; True when it carried generated text or tokens."""
        self.text += text
        if isinstance(ids, list):
            self.ids = (self.ids or []) + [int(t) for t in ids]
        self.finish = finish or self.finish
        return bool(text or ids)


def _choice_text(choice: dict) -> str:
    if "delta" in choice:       # chat: {"delta": {"role", "content"}}
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _usage(usage) -> dict | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None}


# -- connecting -----------------------------------------------------------------------------------------------
# Flags that set up the local engine, with the value that means "not given". With a server generating they
# would do nothing, so they are refused in one line instead of being ignored.
_LOCAL_ENGINE_FLAGS = {"device": ("--device", "auto"), "dtype": ("--dtype", None),
                       "kv_memory": ("--kv-memory", None), "kv_ram": ("--kv-ram", None),
                       "kv_disk": ("--kv-disk", None), "speculate": ("--speculate", None),
                       "num_draft_tokens": ("--num-draft-tokens", None), "draft_model": ("--draft-model", None),
                       "kv_dtype": ("--kv-dtype", None)}


def _refuse_local_engine_flags(opts) -> None:
    if getattr(opts, "quantize", None) not in (None, "none"):
        raise UserError("--quantize quantizes the local engine's weights: not available with --server")
    for field, (flag, unset) in _LOCAL_ENGINE_FLAGS.items():
        value = getattr(opts, field, unset)
        if value != unset and not (field == "speculate" and value == "off"):
            raise UserError(f"{flag} sets up the local engine: not available with --server (the server's own "
                            f"settings decide)")


def open_remote(opts, show_progress: bool = True):
    """(RemoteBackend, ModelEntry) for --server / a remote entry. The server is asked for its models first,
    so an unreachable server, a refused key or a missing model fail here, in one line, before any turn.
    The entry is the local model whose tokenizer and template render the prompts: -m, the remote entry's
    `tokenizer`/`path`, or the model the server names when that is a models.toml entry or a local folder
    (pagedchat serve names a folder model by its path). With none, prompts go as chat messages."""
    from pagedchat.registry import Registry
    from pagedchat.remote import ServerConfig

    _refuse_local_engine_flags(opts)
    registry = Registry()
    entry = registry.resolve(opts.model) if opts.model else None
    table = entry.table if entry is not None else {}
    remote_entry = table.get("kind") == "remote"
    url = opts.server or table.get("server")
    server = Server(ServerConfig(url, api_key=table.get("api_key") if remote_entry else None,
                                 model=table.get("model") if remote_entry else None))
    cards = server.models()
    model = server.config.model or _pick_model(cards, entry, server.url)
    server.config.model = model
    if entry is None:
        entry = _entry_named(registry, model)
    folder = _tokenizer_folder(entry) if entry is not None else None
    tokenizer, eos, limit = _local_tokenizer(folder, entry) if folder is not None else (None, [], None)
    if entry is None:   # nothing local names this model: the server's id stands for it in the session
        from pagedchat.registry import ModelEntry

        entry = ModelEntry(model, Path(model), model, {}, registry.defaults)
    card = next((c for c in cards if c["id"] == model), {})
    served = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None
    max_len = min(x for x in (served, limit, opts.max_context, UNKNOWN_CONTEXT) if x)
    backend = RemoteBackend(server, model, tokenizer, eos, max_len, model_path=str(folder or model))
    return backend, entry


def _pick_model(cards: list[dict], entry, url: str) -> str:
    ids = [c["id"] for c in cards]
    names = {entry.name, str(entry.path), entry.source} if entry is not None else set()
    named = [i for i in ids if i in names]
    if named:
        return named[0]
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise UserError(f"the server at {url} lists no models: name one with a models.toml entry "
                        f"(kind = \"remote\", model = \"...\")")
    raise UserError(f"the server at {url} serves {', '.join(ids)}: pick one with a models.toml entry "
                    f"(kind = \"remote\", server = \"{url}\", model = \"...\")")


def _entry_named(registry, model: str):
    """The models.toml entry or local folder the server's model id names; None when there is none."""
    if registry._lookup(model) is not None:
        return registry.resolve(model)
    return registry.resolve(model) if Path(model).expanduser().is_dir() else None


def _tokenizer_folder(entry) -> Path | None:
    """The local folder holding the tokenizer: a remote entry's `tokenizer` (a folder or models.toml name)
    or `path`; a local entry's own folder (None when it is not on this machine)."""
    from pagedchat.model.loader import find_model_dir
    from pagedchat.registry import Registry

    table = entry.table
    if table.get("kind") == "remote":
        named = table.get("tokenizer")
        if named:
            return _tokenizer_folder(Registry().resolve(named))
        if not (table.get("path") or table.get("source")):
            return None
    try:
        return find_model_dir(str(entry.path), table.get("revision"))
    except UserError:
        if table.get("kind") == "remote" or str(entry.path) == entry.name:
            raise
        return None


def _local_tokenizer(folder: Path, entry):
    """(tokenizer, end-of-turn ids, the model's context limit) read from the folder; no weights load."""
    from pagedchat.model.families import family_for
    from pagedchat.model.loader import architecture_of, eos_ids, load_config, load_tokenizer
    from pagedchat.settings import _read_template

    template = entry.table.get("chat_template")
    trust = bool(entry.table.get("trust_remote_code", False))
    if folder.is_file():   # a GGUF file
        from pagedchat.model.gguf.load import read_tokenizer

        return read_tokenizer(folder, _read_template(template, entry) if template else None)
    tokenizer = load_tokenizer(folder, trust, _read_template(template, entry) if template else None)
    if tokenizer is None:
        return None, [], None
    if not (folder / "config.json").is_file():      # a tokenizer-only folder
        return tokenizer, eos_ids(folder, None, tokenizer), None
    config = load_config(folder, trust)
    # the local engine's limit (model/loader.py): a family that does not apply the config's sliding window
    # itself runs full attention, exact up to the window; a family the local engine cannot run (fine here:
    # the server runs it) is taken at its positions
    family = family_for(architecture_of(config))
    limit = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    if limit and window and family is not None and not family.windowed \
            and getattr(config, "use_sliding_window", True) and window < limit:
        limit = window
    return tokenizer, eos_ids(folder, config, tokenizer), limit
