"""The OpenAI-compatible HTTP API: chat and text completions (streaming or not), models, health, stats;
vLLM's /tokenize and /detokenize; Prometheus /metrics.

Every request becomes engine requests in the one AsyncEngine; handlers only translate between the wire
format and TokenEvents/RequestOutputs. A client that goes away has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import struct
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedchat.engine import SamplingParams
from pagedchat.engine.core.grammar import GrammarError
from pagedchat.engine.core.sampling_params import SETTING_KEYS
from pagedchat.errors import ContextTooLong, PoolTooSmall, UserError
import pagedchat.serve.tools as tools
from pagedchat.serve.async_engine import AsyncEngine, Done, GroupFailed, RequestGroup, Token
from pagedchat.serve.logprobs import TokenText, chat_logprobs, completion_logprobs, merge_completion_logprobs
from pagedchat.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedchat.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      EmbeddingRequest, TokenizeRequest, chat_messages, check_extra_fields,
                                      check_known_fields, check_tokenize_request, completion_prompts,
                                      error_payload, response_grammar, stop_strings, validation_error)

# request fields read by their setting name (max_tokens and stop arrive in OpenAI's own shapes)
SAMPLING_FIELDS = tuple(k for k in SETTING_KEYS if k not in ("max_tokens", "stop"))


@dataclass
class ServeSettings:
    model_name: str                                   # the id clients see in /v1/models and responses
    accepted_models: set[str] = field(default_factory=set)   # aliases and paths also accepted as `model`
    api_key: str | None = None
    sampling_defaults: dict = field(default_factory=dict)    # models.toml / generation_config.json
    system_prompt: str | None = None                  # used when a chat request has no system message
    template_kwargs: dict | None = None
    context_overflow: str = "stop"                    # a request's own context_overflow wins


def create_app(aengine: AsyncEngine, settings: ServeSettings) -> FastAPI:
    started = int(time.time())
    accepted = {settings.model_name, *settings.accepted_models}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(title="pagedchat", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)

    require_key = key_checker(settings.api_key)

    def check_model(name: str) -> None:
        if name not in accepted:
            raise APIError(404, f"The model `{name}` does not exist: this server serves "
                                f"`{settings.model_name}`.", param="model", code="model_not_found")

    def model_card() -> dict:
        # max_model_len as vLLM's cards have it: a client rendering prompts itself (--server) sizes turns by it
        return {"id": settings.model_name, "object": "model", "created": started, "owned_by": "pagedchat",
                "max_model_len": aengine.engine.max_model_len}

    # -- plain endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not aengine.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(require_key)])
    async def get_model(model: str):
        check_model(model)
        return model_card()

    @app.get("/v1/pagedchat/stats", dependencies=[Depends(require_key)])
    @app.get("/stats", dependencies=[Depends(require_key)], include_in_schema=False)
    async def stats():
        engine_stats, counters = await aengine.call(lambda engine: (engine.stats(), asdict(aengine.counters)))
        pool = engine_stats.pool_stats
        return {
            "model": settings.model_name,
            "pool": {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "kv_dtype": pool.kv_dtype,
                     "capacity_tokens": pool.capacity_tokens, "used": pool.used, "free": pool.free,
                     "cached": pool.cached, "shared": pool.shared, "peak_used": pool.peak_used,
                     "prefix_hit_tokens": pool.prefix_hit_tokens, "prefix_query_tokens": pool.prefix_query_tokens,
                     "prefix_hit_rate": round(pool.prefix_hit_rate, 4), "cow_copies": pool.cow_copies,
                     "ram_hit_tokens": pool.ram_hit_tokens, "disk_hit_tokens": pool.disk_hit_tokens},
            "running": engine_stats.running, "waiting": engine_stats.waiting,
            "pinned": engine_stats.pinned, "preemptions": engine_stats.preemptions,
            "requests": counters,
            **({"spec": engine_stats.spec} if engine_stats.spec is not None else {}),
        }

    @app.get("/metrics", dependencies=[Depends(require_key)])
    async def metrics():
        with _api_errors(aengine, None):
            text = await aengine.call(lambda engine: aengine.metrics.render(engine.stats(), settings.model_name))
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    # -- tokens (vLLM's shapes) -----------------------------------------------------------------------------
    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeRequest):
        """A prompt's ids as /v1/completions encodes it; messages' ids as /v1/chat/completions renders them."""
        check_tokenize_request(body)
        if body.model is not None:
            check_model(body.model)
        if body.messages is not None:
            messages, template_kwargs, _, _ = _chat_input(body, settings)
            if body.continue_final_message:
                template_kwargs["continue_final_message"] = True
            generation = body.add_generation_prompt and not body.continue_final_message

            def ids_of(engine) -> list[int]:
                return _chat_tokens(engine, messages, template_kwargs, generation, bool(body.add_special_tokens))
        else:
            def ids_of(engine) -> list[int]:
                return _text_tokens(engine, body.prompt, body.add_special_tokens is not False)

        def tokens(engine) -> dict:
            ids = ids_of(engine)
            reply = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
            if body.return_token_strs:
                reply["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
            return reply

        with _api_errors(aengine, "messages" if body.messages is not None else "prompt"):
            return await aengine.call(tokens)    # on the loop thread, where the tokenizer is used

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeRequest):
        check_known_fields(body)
        if body.model is not None:
            check_model(body.model)
        vocab = aengine.engine.loaded.spec.vocab_size
        outside = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if outside is not None:
            raise APIError(400, f"token id {outside} is outside the vocabulary: ids must be in [0, {vocab})",
                           param="tokens")

        def text(engine) -> str:
            if engine.tokenizer is None:
                raise UserError(f"model {engine.model_path} has no tokenizer")
            return engine.tokenizer.decode(body.tokens)     # special tokens kept, as vLLM's

        with _api_errors(aengine, "tokens"):
            return {"prompt": await aengine.call(text)}

    # -- generation -----------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_extra_fields(body)
        messages, template_kwargs, offered, forced = _chat_input(body, settings)
        params = _sampling_params(body, body.max_completion_tokens or body.max_tokens, settings)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        top = body.top_logprobs or 0
        params = params.with_(logprobs=top if body.logprobs else None)
        tokenizer = aengine.engine.tokenizer
        family = tools.family_of(getattr(tokenizer, "chat_template", None))
        if forced:
            if params.grammar is not None:
                raise APIError(400, "tool_choice required or named cannot be combined with response_format",
                               param="tool_choice")
            params = params.with_(grammar=tools.call_grammar(offered, family, body.parallel_tool_calls is not False))

        drop = (body.context_overflow or settings.context_overflow) == "drop-oldest"

        def prompt_ids(engine) -> list[int]:
            from pagedchat.prompts import render_chat

            ids = render_chat(engine, messages, template_kwargs)
            while drop and _too_long(engine, ids, params) and _drop_oldest_message(messages):
                ids = render_chat(engine, messages, template_kwargs)
            return ids

        group = await _submit(aengine, [prompt_ids], params, "messages")
        reply = _Reply("chatcmpl", settings.model_name, body.n, chat=True, text=TokenText(tokenizer),
                       top_logprobs=top, tool_family=family if offered else None,
                       parallel_tool_calls=body.parallel_tool_calls is not False,
                       token_ids=bool(body.return_token_ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(reply.stream(group, include_usage), group)
        outputs = await _collect(group, request)
        return reply.full(outputs) if outputs is not None else Response(status_code=499)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_extra_fields(body)
        params = _sampling_params(body, body.max_tokens, settings)
        params = params.with_(logprobs=body.logprobs, prompt_logprobs=body.logprobs if body.echo else None)
        prompts = completion_prompts(body)

        drop = (body.context_overflow or settings.context_overflow) == "drop-oldest"

        def raw_ids(prompt):
            def build(engine) -> list[int]:
                ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
                if drop and _too_long(engine, ids, params):    # keep the end of the text, room for the reply
                    ids = ids[-max(1, engine.max_model_len - min(params.max_tokens, engine.max_model_len // 2)):]
                return ids
            return build

        group = await _submit(aengine, [raw_ids(p) for p in prompts], params, "prompt")
        text = TokenText(aengine.engine.tokenizer)
        prompt_texts = [p if isinstance(p, str) else text.tokenizer.decode(p) for p in prompts] \
            if body.echo or body.logprobs is not None else None
        reply = _Reply("cmpl", settings.model_name, body.n, chat=False, text=text, prompt_texts=prompt_texts,
                       echo=bool(body.echo), token_ids=bool(body.return_token_ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(reply.stream(group, include_usage), group)
        outputs = await _collect(group, request)
        return reply.full(outputs) if outputs is not None else Response(status_code=499)

    @app.post("/v1/embeddings", dependencies=[Depends(require_key)])
    async def embeddings(body: EmbeddingRequest, request: Request):
        """Mean of the last layer's hidden states (after the final norm) over every input token, computed by
        a prefill in the shared pool (chunked like any prompt)."""
        check_model(body.model)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: embeddings have the model's hidden size",
                           param="dimensions")
        inputs = completion_prompts(body)

        def raw_ids(item):
            def build(engine) -> list[int]:
                return engine.encode(item) if isinstance(item, str) else list(item)
            return build

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, embed=True)
        group = await _submit(aengine, [raw_ids(i) for i in inputs], params, "input")
        outputs = await _collect(group, request)
        if outputs is None:
            return Response(status_code=499)
        _raise_output_error(outputs)
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(o.embedding, body.encoding_format)}
                for i, o in enumerate(outputs)]
        tokens = sum(o.num_prompt_tokens for o in outputs)
        return {"object": "list", "data": data, "model": settings.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    app.state.aengine = aengine
    app.state.settings = settings
    app.state.require_key = require_key     # the web page's API (pagedchat/web) takes the same key
    return app


def key_checker(api_key: str | None):
    """A FastAPI dependency: with an API key set, every request must carry it as a bearer token."""
    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the key "
                                "given to `pagedchat serve --api-key`.", code="invalid_api_key")
    return require_key


def _encode_vector(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


# -- request -> engine ------------------------------------------------------------------------------------------
def _chat_input(body: ChatCompletionRequest | TokenizeRequest,
                settings: ServeSettings) -> tuple[list, dict, list, bool]:
    """(messages, template kwargs, tools offered, must one be called) as the chat template gets them. Chat
    completions and /tokenize both build their prompt here, so /tokenize's ids are the completion's."""
    messages = chat_messages(body)
    if settings.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": settings.system_prompt})
    offered, forced = tools.chosen_tools(tools.checked_tools(body.tools), getattr(body, "tool_choice", None))
    template_kwargs = dict(settings.template_kwargs or {}, **({"tools": offered} if offered else {}))
    return tools.template_messages(messages), template_kwargs, offered, forced


def _text_tokens(engine, prompt: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return engine.encode(prompt)       # exactly what /v1/completions feeds the model for this text
    if engine.tokenizer is None:
        raise UserError(f"model {engine.model_path} has no tokenizer")
    return list(engine.tokenizer(prompt, add_special_tokens=False).input_ids)


def _chat_tokens(engine, messages: list[dict], template_kwargs: dict, add_generation_prompt: bool,
                 add_special_tokens: bool) -> list[int]:
    """The chat template's ids (the chat completion's own rendering); with add_special_tokens, the rendered
    text is tokenized with the tokenizer's special tokens on top (vLLM's meaning: BOS twice, often)."""
    from pagedchat.prompts import render_chat

    ids = render_chat(engine, messages, template_kwargs, add_generation_prompt)   # and its checks and errors
    if not add_special_tokens:
        return ids
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **template_kwargs)
    return list(engine.tokenizer(text).input_ids)


def _sampling_params(body, max_tokens: int | None, settings: ServeSettings) -> SamplingParams:
    """Request fields over the model's defaults (models.toml, generation_config.json), by the CLI's rule
    (settings.merge_sampling): the model's own stop strings stay in force, the request's are added."""
    from pagedchat.settings import merge_sampling

    request = {k: getattr(body, k) for k in SAMPLING_FIELDS if getattr(body, k) is not None}
    if request.get("top_k") == -1:
        request["top_k"] = 0
    request["max_tokens"] = max_tokens
    request["stop"] = stop_strings(body.stop) or None
    model = {k: (v, "model") for k, v in settings.sampling_defaults.items()}
    try:
        params, _ = merge_sampling(model, {**request, "__source__": "request"})
        if body.use_beam_search:   # the best n of best_of beams (beam search returns its beams, best first)
            return params.with_(n=1, ignore_eos=body.ignore_eos, beam_width=body.best_of or body.n,
                                length_penalty=body.length_penalty, early_stopping=body.early_stopping)
        return params.with_(n=body.n, ignore_eos=body.ignore_eos,
                            grammar=response_grammar(getattr(body, "response_format", None)))
    except UserError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


def _too_long(engine, ids: list[int], params: SamplingParams) -> bool:
    """No room for the reply: max_tokens, or half the context if that asks for more."""
    return len(ids) + min(params.max_tokens, engine.max_model_len // 2) > engine.max_model_len


def _drop_oldest_message(messages: list[dict]) -> bool:
    """Drop the oldest message that is not a system message, keeping the last one; False if none can go."""
    first = next((i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None)
    if first is None:
        return False
    del messages[first]
    while first < len(messages) - 1 and messages[first]["role"] not in ("user", "system"):
        del messages[first]     # the dropped turn's reply and tool results go with it: a turn starts with a user
    return True


def _context_error(e: ContextTooLong | PoolTooSmall, param: str) -> APIError:
    """The engine's fit checks in OpenAI's words (context_length_exceeded)."""
    if isinstance(e, ContextTooLong):
        message = (f"This model's maximum context length is {e.max_model_len} tokens. However, your {param} "
                   f"resulted in {e.prompt_tokens} tokens (at least one token must be left for the reply).")
    else:
        message = (f"The prompt is {e.prompt_tokens} tokens but the server's whole KV pool holds "
                   f"{e.capacity_tokens} tokens (restart it with a larger --kv-memory).")
    return APIError(400, message, param=param, code="context_length_exceeded")


async def _submit(aengine: AsyncEngine, prompts, params: SamplingParams, param: str) -> RequestGroup:
    """Queue the prompts; errors raised while building or adding them become 400s (nothing is queued)."""
    with _api_errors(aengine, param):
        return await aengine.add(prompts, params)


@contextmanager
def _api_errors(aengine: AsyncEngine, param: str | None):
    """Errors of work done on the engine loop (templates, tokenizer, engine checks) as OpenAI errors."""
    try:
        yield
    except APIError:
        raise
    except GrammarError as e:
        raise APIError(400, str(e), param="response_format") from None
    except (ContextTooLong, PoolTooSmall) as e:
        raise _context_error(e, param) from None
    except UserError as e:    # engine checks on the prompt: empty, token ids outside the vocabulary, ...
        raise APIError(400, str(e), param=param) from None
    except Exception as e:
        if type(e).__module__.startswith("jinja2"):   # the chat template rejected the messages
            raise APIError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None
        if isinstance(e, RuntimeError) and not aengine.alive:
            raise APIError(503, "the server is shutting down", type="server_error") from None
        raise


async def _collect(group: RequestGroup, request: Request):
    """Wait for every output of a non-streaming call; None (and the requests aborted) if the client leaves."""
    async def drain():
        async for _ in group:
            pass
        return group.outputs

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            group.abort()
    if not work.done() or work.cancelled():
        return None
    try:
        return work.result()
    except GroupFailed as e:
        raise APIError(e.failure.status, e.failure.message, type="server_error", code=e.failure.code) from None
    finally:
        group.abort()        # no-op when complete; drops the group from the open set


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read, so receive() only reports
    the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- engine -> response -----------------------------------------------------------------------------------------
class _Reply:
    """Builds the response body (or the SSE chunks) of one call from its outputs."""

    def __init__(self, prefix: str, model: str, n: int, chat: bool, text: TokenText | None = None,
                 top_logprobs: int = 0, prompt_texts: list[str] | None = None, echo: bool = False,
                 tool_family: str | None = None, parallel_tool_calls: bool = True, token_ids: bool = False):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.n, self.chat = model, n, chat
        self.object = "chat.completion" if chat else "text_completion"
        self.text, self.top_logprobs = text, top_logprobs
        self.prompt_texts, self.echo = prompt_texts, echo
        self.tool_family, self.parallel_tool_calls = tool_family, parallel_tool_calls
        self.token_ids = token_ids       # return_token_ids: every choice (chunk) carries its generated ids

    def _choice(self, index: int, text: str | None, finish_reason: str | None, delta: bool = False,
                logprobs: dict | None = None, tool_calls: list[dict] | None = None, ids: list[int] | None = None) -> dict:
        choice = self._choice_body(index, text, finish_reason, delta, logprobs, tool_calls)
        if self.token_ids and ids is not None:
            choice["token_ids"] = list(ids)
        return choice

    def _choice_body(self, index, text, finish_reason, delta, logprobs, tool_calls) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if delta:
            body = {"content": text} if text is not None else {}
            if tool_calls:
                body["tool_calls"] = tool_calls
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _tool_calls(self, text: str) -> tuple[str | None, list]:
        """(content, calls) of a finished chat reply when tools were offered."""
        if self.tool_family is None:
            return text, []
        content, calls = tools.parse_reply(text, self.tool_family)
        return content, calls if self.parallel_tool_calls else calls[:1]

    def _logprobs(self, slot: int, entries, prompt_entries=None, prompt_ids=None, offset: int = 0) -> dict | None:
        """One choice's (or one chunk's) logprobs; prompt_entries: echo's scored prompt tokens."""
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(self.text, entries, self.top_logprobs)
        parts = []
        if prompt_entries is not None:
            parts.append(completion_logprobs(self.text, prompt_entries, 0, echo_first=prompt_ids[0]))
        parts.append(completion_logprobs(self.text, entries, offset))
        return merge_completion_logprobs(parts)

    def _echoed(self, slot: int) -> str:
        return self.prompt_texts[slot] if self.echo else ""

    def full(self, outputs) -> dict:
        _raise_output_error(outputs)
        choices = []
        for slot, out in enumerate(outputs):
            for c in out.outputs:
                if c.index >= self.n:
                    continue   # beam search: hypotheses past the n best asked for
                prompt_len = len(self.prompt_texts[slot]) if self.prompt_texts else 0
                logprobs = self._logprobs(slot, c.logprobs, out.prompt_logprobs if self.echo else None,
                                          out.prompt_token_ids, prompt_len)
                text = self._echoed(slot) + c.text if not self.chat else c.text
                text, calls = self._tool_calls(text) if self.chat else (text, [])
                finish = "tool_calls" if calls else _finish(c.finish_reason)
                choice = self._choice(slot * self.n + c.index, text, finish, logprobs=logprobs,
                                      tool_calls=[call.openai() for call in calls], ids=c.token_ids)
                if self.token_ids and not self.chat:    # vLLM's: each completion choice names its prompt
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(outputs), "system_fingerprint": None}
        if self.token_ids and self.chat:      # vLLM's: the ids the chat template gave, beside the reply's
            body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
        return body

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "system_fingerprint": None}
        if usage is not None:
            body["usage"] = usage
        return _sse(body)

    async def stream(self, group: RequestGroup, include_usage: bool):
        slots = len(group.outputs)
        offsets: dict[int, int] = {}     # choice -> characters streamed so far (completions text_offset)
        held: dict[int, str] = {}        # choice -> text held back: it may be (the start of) a tool call
        sent: dict[int, str] = {}        # choice -> content streamed (tool replies only)
        calling: set[int] = set()        # choices whose tool call has begun: all further text is held
        streams: dict[int, tools.CallStream] = {}   # choice -> its tool calls, streamed as they are written
        if self.chat:   # OpenAI opens every choice with its role
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(slots * self.n)])
        try:
            async for item in group:
                if isinstance(item, Done) and item.output.error:
                    yield _sse(error_payload(item.output.error, code="kv_pool_exhausted"))
                    break
                if not isinstance(item, Token) or item.event.finish_reason == "error" or item.event.index >= self.n:
                    continue   # (beam search: hypotheses past the n best asked for)
                event, index = item.event, item.slot * self.n + item.event.index
                if index not in offsets:
                    offsets[index] = len(self.prompt_texts[item.slot]) if self.prompt_texts else 0
                    if self.echo:
                        echo = self._logprobs(item.slot, [] if event.logprobs is not None else None,
                                              event.prompt_logprobs, group.prompt_ids[item.slot])
                        yield self._chunk([self._choice(index, self.prompt_texts[item.slot], None, delta=True,
                                                        logprobs=echo)])
                        offsets[index] = len(self.prompt_texts[item.slot])
                logprobs = self._logprobs(item.slot, event.logprobs, offset=offsets[index])
                text = held.pop(index, "") + event.text
                if self.tool_family is not None:     # hold back what may be the start of a tool call
                    cut = 0 if index in calling else tools.holds_back(text, self.tool_family)
                    if cut < len(text):
                        calling.add(index)
                    text, held[index] = text[:cut], text[cut:]
                    sent[index] = sent.get(index, "") + text
                ids = event.token_ids if self.token_ids else None
                if text or logprobs is not None or ids:
                    yield self._chunk([self._choice(index, text, None, delta=True, logprobs=logprobs, ids=ids)])
                if index in calling:
                    stream = streams.setdefault(index, tools.CallStream(self.parallel_tool_calls))
                    deltas = stream.feed(held[index])
                    if deltas:
                        yield self._chunk([self._choice(index, None, None, delta=True, tool_calls=deltas)])
                offsets[index] += len(event.text)
                if event.finish_reason:
                    finish, tail = _finish(event.finish_reason), held.pop(index, "")
                    if self.tool_family is not None:
                        content, calls = self._tool_calls(sent.get(index, "") + tail)
                        streamed = streams.get(index, tools.CallStream())
                        if calls or streamed.calls:     # what was held is calls, not content
                            rest, _ = streamed.rest(calls)
                            tail = (content or "")[len(sent.get(index, "")):] if calls else ""
                            finish = "tool_calls" if calls else finish   # a call cut by max_tokens: length
                            deltas = [call.openai(len(streamed.calls) + i) for i, call in enumerate(rest)]
                            if tail or deltas:   # calls not streamed as they came (index i: call i)
                                yield self._chunk([self._choice(index, tail or None, None, delta=True,
                                                                tool_calls=deltas or None)])
                            tail = ""
                    if tail:
                        yield self._chunk([self._choice(index, tail, None, delta=True)])
                    yield self._chunk([self._choice(index, None if self.chat else "", finish, delta=True)])
            else:
                if include_usage:
                    yield self._chunk([], usage=_usage(group.outputs))
        except GroupFailed as e:
            yield _sse(error_payload(e.failure.message, type="server_error", code=e.failure.code))
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose requests are aborted however the response ends (client gone, cancelled
    before the first chunk, server stopping)."""

    def __init__(self, chunks, group: RequestGroup):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


# Characters str.splitlines() ends a line at, besides CR and LF, that JSON leaves unescaped: an event stream's
# lines end only at CR/LF, but clients that split with splitlines (httpx's aiter_lines among them) cut a
# reply's JSON at them ("Unterminated string"); escaped, the event is the same JSON on one line for everyone.
_LINE_BREAKING = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKING)}\n\n"


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else reason and "stop"


def _usage(outputs) -> dict:
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.prefix_hit_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _raise_output_error(outputs) -> None:
    for out in outputs:
        if out.error:
            raise APIError(400, out.error, code="kv_pool_exhausted")


# -- errors in OpenAI's shape -----------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.payload(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        error = validation_error(list(exc.errors()))
        return JSONResponse(error.payload(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}."
            return JSONResponse(error_payload(message, code="unknown_url"), status_code=404)
        return JSONResponse(error_payload(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return JSONResponse(error_payload(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                            status_code=500)
