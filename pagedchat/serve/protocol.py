"""The OpenAI wire format: request models, the error shape, and which OpenAI fields we accept.

Requests are validated by pydantic; fields pydantic does not declare land in `model_extra` and are sorted
here: harmless ones are ignored, unsupported ones are accepted only at their no-op value (0, null, false,
empty), and anything else is rejected the way OpenAI does ("Unrecognized request argument supplied").
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pagedchat.engine.core.grammar import GrammarSpec
from pagedchat.engine.core.logprobs import MAX_TOP_LOGPROBS
from pagedchat.settings import MAX_SERVER_VARIANTS


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def payload(self) -> dict:
        return error_payload(self.message, self.type, self.param, self.code)


def error_payload(message: str, type: str = "invalid_request_error", param: str | None = None,
                  code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = False


class _GenerationRequest(BaseModel):
    """Fields shared by chat and text completions. Extensions (vLLM-style): top_k, min_p,
    repetition_penalty, ignore_eos."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_SERVER_VARIANTS)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)          # -1 or 0 = off
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    max_tokens: Optional[int] = Field(None, ge=1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # beam search as vLLM's OpenAI server took it: best_of beams (default n), the best n returned
    use_beam_search: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=MAX_SERVER_VARIANTS)
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    response_format: Optional[dict[str, Any]] = None    # text | json_object | json_schema (completions too)
    # pagedchat extension: a prompt over the context is a 400 context_length_exceeded unless the request
    # opts in to drop-oldest (chat: the oldest non-system messages go; text: the prompt keeps its end)
    context_overflow: Optional[Literal["stop", "drop-oldest"]] = None
    # vLLM's extension: each choice (each streamed chunk) also carries the generated token ids, so a client
    # that renders prompts itself (pagedchat chat/run --server) keeps its history token-exact
    return_token_ids: Optional[bool] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, refusal, ... are ignored; tool_calls is checked

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None      # none | auto | required | {"function": ...}
    parallel_tool_calls: Optional[bool] = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


class CompletionRequest(_GenerationRequest):
    # A string, a list of strings (a batch), token ids, or a list of token-id lists (a batch).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # alternatives per token
    echo: Optional[bool] = False                                       # the prompt (and its scores) first


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered by the chat template as a chat
    completion renders them. add_special_tokens (BOS and the like) defaults as vLLM's does: true for a
    prompt, false for messages (the template writes its own)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    tokens: list[StrictInt]        # strict: "5" or 5.0 is a client's mistake, not an id


def check_tokenize_request(request: TokenizeRequest) -> None:
    """Exactly one of prompt and messages; the chat-only switches used consistently."""
    check_known_fields(request)
    if (request.prompt is None) == (request.messages is None):
        raise APIError(400, "give either \"prompt\" (text) or \"messages\" (a chat), not "
                            f"{'both' if request.prompt is not None else 'neither'}", param="prompt")
    if request.continue_final_message and request.add_generation_prompt \
            and "add_generation_prompt" in request.model_fields_set:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")


def check_known_fields(request: BaseModel) -> None:
    """Fields the model does not declare are refused by name (OpenAI's wording), not silently ignored."""
    for name in request.model_extra or {}:
        if name not in IGNORED_FIELDS:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)


# -- fields OpenAI defines that we do not implement -----------------------------------------------------------
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}


def _none_or(*values):
    return lambda v: v is None or any(v == ok and type(v) is type(ok) for ok in values)


# field -> (is the value a no-op?, hint shown when it is not)
NOOP_FIELDS: dict[str, tuple[Any, str]] = {
    "presence_penalty": (_none_or(0, 0.0), "only 0 is supported; use repetition_penalty instead"),
    "frequency_penalty": (_none_or(0, 0.0), "only 0 is supported; use repetition_penalty instead"),
    "logit_bias": (_none_or({}), "logit_bias is not supported"),
    "functions": (_none_or([]), "function calling is not supported"),
    "function_call": (_none_or("none", "auto"), "function calling is not supported"),
    "modalities": (_none_or(["text"]), "only text is supported"),
    "audio": (_none_or(), "audio output is not supported"),
    "prediction": (_none_or(), "predicted outputs are not supported"),
    "web_search_options": (_none_or(), "web search is not supported"),
    "reasoning_effort": (_none_or(), "reasoning_effort is not supported"),
    "verbosity": (_none_or(), "verbosity is not supported"),
    "suffix": (_none_or(""), "suffix (insertion) is not supported"),
}


def check_extra_fields(request: _GenerationRequest) -> None:
    """Reject fields we cannot honour, naming the field (OpenAI's own wording for unknown ones)."""
    for name, value in (request.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        rule = NOOP_FIELDS.get(name)
        if rule is None:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
        is_noop, hint = rule
        if not is_noop(value):
            raise APIError(400, f"{name}={value!r} is not supported by pagedchat serve: {hint}", param=name)
    check_beam_fields(request)


def check_beam_fields(request: _GenerationRequest) -> None:
    """best_of means beams with use_beam_search; without it, only best_of == n (no server-side ranking)."""
    if request.use_beam_search:
        if request.best_of is not None and request.best_of < request.n:
            raise APIError(400, f"best_of ({request.best_of}) must be >= n ({request.n})", param="best_of")
    elif request.best_of is not None and request.best_of != request.n:
        raise APIError(400, f"best_of={request.best_of} is not supported without use_beam_search: best_of must "
                            f"equal n", param="best_of")


def chat_messages(request: ChatCompletionRequest) -> list[dict]:
    """The request's messages as {"role", "content"} dicts for the chat template; an assistant's tool_calls
    and a tool result's tool_call_id come along (the legacy function-call forms do not)."""
    out = []
    for i, message in enumerate(request.messages):
        extra = message.model_extra or {}
        if extra.get("function_call") or message.role == "function":
            raise APIError(400, f"messages[{i}]: legacy function messages are not supported: use tools",
                           param=f"messages[{i}]")
        role = "system" if message.role == "developer" else message.role
        item = {"role": role, "content": _message_text(message.content, i)}
        if role == "assistant" and extra.get("tool_calls"):
            item["tool_calls"] = extra["tool_calls"]
        if role == "tool":
            item["tool_call_id"] = extra.get("tool_call_id")
        out.append(item)
    return out


def _message_text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}].content[{j}]: only text content parts are supported "
                                f"(got type {part.get('type')!r})", param=f"messages[{i}].content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def completion_prompts(request: CompletionRequest | EmbeddingRequest) -> list[str | list[int]]:
    """The prompt (or embeddings input) field as a batch: each item is text (encoded raw) or token ids."""
    prompt = request.prompt if isinstance(request, CompletionRequest) else request.input
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if any(not p for p in prompt):
        raise APIError(400, "prompt must not contain empty prompts", param="prompt")
    return list(prompt)


def response_grammar(response_format: dict | None) -> GrammarSpec | None:
    """OpenAI's response_format as a grammar: text (none), json_object, or json_schema {name, schema, strict}."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise APIError(400, "response_format.json_schema must be an object with a \"schema\" object",
                           param="response_format.json_schema")
        return GrammarSpec.json_schema(spec.get("schema", {}))
    raise APIError(400, f"response_format type {kind!r} is not supported: use text, json_object or json_schema",
                   param="response_format.type")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# Fields typed as unions: pydantic reports one error per member, so say once what is allowed instead.
_UNION_FIELDS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic/FastAPI validation error as one clear 400 naming the first bad field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg')}")
    path, union = [], False
    for part in first.get("loc", ()):
        if part == "body":
            continue
        if isinstance(part, str) and (part in _TYPE_NAMES or "[" in part):
            union = True            # a union member's name, not a field
            break
        path.append(part)
    param = ""
    for part in path:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    if not param:
        return APIError(400, f"invalid request body: {first.get('msg')}")
    field = next((p for p in reversed(path) if isinstance(p, str)), "")
    message = _UNION_FIELDS.get(field) if union else None
    return APIError(400, f"{param}: {message or first.get('msg')}", param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}
