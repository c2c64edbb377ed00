"""The wire to an OpenAI-compatible server (`--server URL`: pagedchat serve, vLLM, SGLang, llama.cpp's
llama-server): list its models, stream a completion as server-sent events, and turn every way it can fail
into one line a user can act on. Knows JSON and HTTP only: what a turn is lives in chat/remote_backend.py.

httpx, not the openai client: the openai client is a test dependency only, and the extension fields
(`return_token_ids`, `top_k`, ...) and error bodies are plainer to handle as JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagedchat.errors import UserError

API_KEY_ENV = "PAGEDCHAT_API_KEY"   # never OPENAI_API_KEY: that key must not go to an arbitrary server


class RemoteError(UserError):
    """A server that could not be reached, refused the request, or broke off. status: the HTTP status (None
    when there was no answer); refused_prompt: a 400/404/422 that says it cannot take this kind of prompt."""

    def __init__(self, message: str, status: int | None = None, refused_prompt: bool = False):
        super().__init__(message)
        self.status, self.refused_prompt = status, refused_prompt


class ReplyFailed(RemoteError):
    """The reply had started and failed on the server's side: exit 1, as a failed reply does locally (2 is
    for what the user can fix: the URL, the key, the model name)."""

    exit_code = 1


class StreamDropped(ReplyFailed):
    """The server closed the stream before the reply ended (it died, restarted, or a proxy cut it)."""


@dataclass
class ServerConfig:
    url: str                        # as given; base() adds /v1 when missing
    api_key: str | None = None
    model: str | None = None        # the id the server serves; None: ask /v1/models
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0   # longest wait for the next chunk (a long prompt's prefill comes first)

    def base(self) -> str:
        url = self.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--server {self.url!r}: give an http:// or https:// URL (e.g. http://host:8000/v1)")
        return url if url.endswith("/v1") else url + "/v1"


class Server:
    """One OpenAI-compatible server. Methods raise RemoteError with one line; nothing else escapes."""

    def __init__(self, config: ServerConfig):
        import httpx

        self.config = config
        self.url = config.base()
        key = config.api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    # -- plain calls ----------------------------------------------------------------------------------------
    def models(self) -> list[dict]:
        """The model cards of GET /v1/models (id, and max_model_len where the server says it)."""
        body = self._call(lambda: self.client.get("/models"), "/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise RemoteError(f"{self.url}/models did not answer with a model list: is this an OpenAI-compatible "
                              f"server?")
        return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]

    def _call(self, send, path: str):
        import httpx

        try:
            response = send()
        except httpx.HTTPError as e:
            raise self._transport_error(e, path) from None
        if response.status_code >= 400:
            raise self._status_error(response.status_code, response.text, path)
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.url}{path} answered with something that is not JSON") from None

    # -- streaming ------------------------------------------------------------------------------------------
    def stream(self, path: str, body: dict):
        """Yield the JSON chunks of a streamed POST (path: /completions or /chat/completions) until
        `data: [DONE]`. Closing the generator closes the connection (the server aborts the request)."""
        import httpx

        try:
            with self.client.stream("POST", path, json={**body, "stream": True}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._status_error(response.status_code, response.text, path)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue            # blank separators, `: keep-alive` comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = _json_or_none(data)
                    if isinstance(chunk, dict) and chunk.get("error"):
                        raise ReplyFailed(f"the server at {self.url} failed mid-reply: {_error_text(chunk)}")
                    if isinstance(chunk, dict):
                        yield chunk
        except httpx.HTTPError as e:
            raise self._transport_error(e, path) from None
        raise StreamDropped(f"the server at {self.url} closed the stream before the reply finished")

    # -- errors ---------------------------------------------------------------------------------------------
    def _transport_error(self, e, path: str) -> RemoteError:
        import httpx

        if isinstance(e, httpx.ConnectError):
            reason = str(e).split("] ")[-1] or "connection refused"
            return RemoteError(f"cannot connect to the server at {self.url}: {reason} (is it running?)")
        if isinstance(e, httpx.ConnectTimeout):
            return RemoteError(f"cannot connect to the server at {self.url}: no answer within "
                               f"{self.config.connect_timeout_s:g}s")
        if isinstance(e, httpx.TimeoutException):
            return RemoteError(f"the server at {self.url} sent nothing for {self.config.read_timeout_s:g}s "
                               f"({path}); it may be overloaded")
        if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            return StreamDropped(f"the server at {self.url} closed the connection before the reply finished")
        return RemoteError(f"talking to the server at {self.url} failed: {type(e).__name__}: {e}")

    def _status_error(self, status: int, text: str, path: str) -> RemoteError:
        body = _json_or_none(text)
        detail = _error_text(body) if body is not None else " ".join(text.split())[:200]
        code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
        if status == 401 or status == 403:
            return RemoteError(f"the server at {self.url} refused the API key ({status}): set api_key in the "
                               f"models.toml entry or {API_KEY_ENV}", status)
        if status == 404 and (code == "model_not_found" or "model" in detail.lower()):
            return RemoteError(f"the server at {self.url} has no model {self.config.model!r} (404): {detail}", status)
        if status == 404:
            return RemoteError(f"the server at {self.url} has no {path} endpoint (404)", status, refused_prompt=True)
        # "cannot take this kind of prompt" (the caller falls back to messages), not "this prompt is too long"
        too_long = code == "context_length_exceeded" or any(w in detail.lower() for w in ("context", "too long"))
        refused = status in (400, 422) and "prompt" in detail.lower() and not too_long
        return RemoteError(f"the server at {self.url} answered {status}: {detail}", status, refused_prompt=refused)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _error_text(body) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message"}}), or of the shapes others send."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail") or json.dumps(error)[:200]
        else:
            message = str(error)
        return " ".join(str(message).split())[:300]
    return " ".join(str(body).split())[:300]
