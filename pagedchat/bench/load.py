"""The load generator of `pagedchat bench serve`: seeded workloads, Poisson arrivals, streaming clients.

A workload is fixed by its seed before any request is sent, so both modes at one rate get exactly the same
requests at the same offsets. A random model never ends a reply on cue, so each request carries the reply
length drawn for it: the client stops reading after that many tokens (closing the stream ends the request
on the server, which frees its blocks at once: to the server it is a reply that ended there). The request
still declares `max_tokens`, the cap a client must ask for when it cannot know the length in advance, and
that is what up-front reservation has to hold.

Workloads:
  lognormal  independent requests; prompt and reply lengths lognormal; token-id prompts (/v1/completions)
  chat       users holding multi-turn conversations (/v1/chat/completions): each next turn sends the whole
             history (every earlier message and reply) plus a new message, after a think time
Either can start every prompt with a shared system prompt (`system_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pagedchat.bench.common import lognormal_lengths

FIRST_ID = 3            # random prompt ids skip the special tokens (pad 0, bos/im_start 1, eos 2)


@dataclass
class Workload:
    kind: str = "lognormal"            # lognormal | chat
    requests: int = 60                 # per rate (chat: turns in all, rounded to whole conversations)
    mean_prompt: float = 64            # tokens of a prompt (chat: of each new user message)
    mean_output: float = 48            # tokens of a reply (where the client stops reading)
    sigma: float = 0.8                 # lognormal shape of both
    max_prompt: int = 512
    max_output: int = 200
    max_tokens: int = 256              # declared per request: what up-front reservation must hold
    system_tokens: int = 0             # shared system prompt, 0 = none
    turns: int = 4                     # chat: turns per conversation
    think_s: float = 0.5               # chat: mean pause between a reply and the user's next message
    seed: int = 0


@dataclass
class Turn:
    prompt: list[int]                  # new tokens of this turn (the whole prompt for lognormal)
    reply_tokens: int                  # where the client stops reading
    seed: int                          # sampling seed: the same reply in both modes


@dataclass
class Conversation:
    start_s: float                     # arrival offset of its first request
    turns: list[Turn]
    think_s: list[float]               # pause before each turn after the first


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0


def make_conversations(w: Workload, rate: float, vocab: int, rate_index: int) -> list[Conversation]:
    """The requests of one rate: Poisson arrivals at `rate` requests/s (chat: conversations arrive at
    rate / turns, so turns arrive at `rate` on average). Seeded by (seed, rate index): both modes see the same
    requests at a rate, and no rate repeats the prompts of another (no prefix hits carried over)."""
    rng = random.Random(w.seed * 1000 + rate_index)
    turns = w.turns if w.kind == "chat" else 1
    count = max(1, round(w.requests / turns))
    lengths = lognormal_lengths(rng, count * turns, w.mean_prompt, w.sigma, 1, w.max_prompt)
    replies = lognormal_lengths(rng, count * turns, w.mean_output, w.sigma, 1, min(w.max_output, w.max_tokens))
    t, out = 0.0, []
    for c in range(count):
        t += rng.expovariate(rate / turns)
        chunk = range(c * turns, (c + 1) * turns)
        out.append(Conversation(
            start_s=t,
            turns=[Turn([rng.randrange(FIRST_ID, vocab) for _ in range(lengths[i])], replies[i], rng.randrange(2**31))
                   for i in chunk],
            think_s=[rng.expovariate(1 / w.think_s) if w.think_s > 0 else 0.0 for _ in range(turns - 1)]))
    return out


def system_prompt(w: Workload, vocab: int) -> list[int]:
    rng = random.Random(-1 - w.seed)   # one system prompt for the whole run: every rate and mode
    return [rng.randrange(FIRST_ID, vocab) for _ in range(w.system_tokens)]


class Client:
    """Streams one request at a time per conversation and measures it from the client's side."""

    def __init__(self, http, base_url: str, model: str, w: Workload, system: list[int], decode, timeout_s: float):
        self.http, self.base, self.model, self.w = http, base_url.rstrip("/"), model, w
        self.system, self.decode, self.timeout_s = system, decode, timeout_s

    async def conversation(self, conv: Conversation, t0: float, done) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
        messages = [{"role": "system", "content": self.decode(self.system)}] if self.system else []
        results = []
        for i, turn in enumerate(conv.turns):
            if i:
                await asyncio.sleep(conv.think_s[i - 1])
            if self.w.kind == "chat":
                messages.append({"role": "user", "content": self.decode(turn.prompt)})
                body = {"messages": messages}
                result, reply = await self._stream("/chat/completions", body, turn)
                messages.append({"role": "assistant", "content": reply})
            else:
                body = {"prompt": self.system + turn.prompt}
                result, _ = await self._stream("/completions", body, turn)
            results.append(result)
            done()
            if not result.ok:
                break          # a conversation whose turn failed cannot go on (its history is incomplete)
        return results

    async def _stream(self, path: str, body: dict, turn: Turn) -> tuple[RequestResult, str]:
        body = dict(body, model=self.model, stream=True, max_tokens=self.w.max_tokens, temperature=1.0,
                    seed=turn.seed, ignore_eos=True)
        start = time.perf_counter()
        stamps, text = [], []
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.stream("POST", self.base + path, json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace")[:200]
                        return RequestResult(False, f"HTTP {response.status_code}: {detail}"), ""
                    async for piece, error in _sse_texts(response):
                        if error:
                            return RequestResult(False, error), ""
                        stamps.append(time.perf_counter())
                        text.append(piece)
                        if len(stamps) >= turn.reply_tokens:
                            break        # the reply ends here: closing the stream frees its blocks
        except TimeoutError:
            return RequestResult(False, f"no reply within {self.timeout_s:g} s"), ""
        except Exception as e:  # connection refused or reset: a failed request, never a crashed benchmark
            return RequestResult(False, f"{type(e).__name__}: {e}"), ""
        if not stamps:
            return RequestResult(False, "the stream ended without a token"), ""
        itl = [b - a for a, b in zip(stamps, stamps[1:])]
        return RequestResult(True, None, stamps[0] - start, stamps[-1] - start, itl, len(stamps)), "".join(text)


async def _sse_texts(response):
    """(text, None) for every non-empty text delta of an OpenAI event stream; (None, message) on an error."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            yield None, str(event["error"].get("message", event["error"]))
            return
        for choice in event.get("choices", []):
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if piece:
                yield piece, None
