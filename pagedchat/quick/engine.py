"""QuickEngine: the Engine calls `pagedchat run` makes (add_request, steps, pop_output, ...), for one request
of one sequence, over a GGUF file bound to decode.c (quick/model.py). Requests and their outputs are the
engine's own types, and each token goes through the engine's OutputProcessor (stop tokens and strings, the
length limit, text held back while it could still become a stop string), so a reply reads the same.

Its pool is paged like the engine's, with the blocks of one sequence in order; there is nothing to share,
fork or evict, so there is no block manager. A prompt is prefilled CHUNK tokens per step, the last chunk
sampling the first token; then one token per step.
"""

from __future__ import annotations

import itertools
import os
import time
from types import SimpleNamespace
from typing import Iterable, Iterator

import numpy as np

from pagedchat.engine.core.output_processor import OutputProcessor
from pagedchat.engine.core.sampling_params import SamplingParams
from pagedchat.engine.core.sequence import Request, Sequence, SeqStatus
from pagedchat.engine.kv.block_pool import PoolStats
from pagedchat.engine.outputs import CompletionOutput, RequestOutput, TokenEvent
from pagedchat.errors import ContextTooLong, EmptyPrompt, PoolTooSmall, RequestError, outgrew_pool
from pagedchat.native import abi
from pagedchat.quick.model import QuickModel
from pagedchat.quick.sample import pick

# Prompt tokens per prefill step: decode.c's tiles are made for few rows, and its time per prompt token is about
# the same from 16 to 256 rows (engine/core/runner.py NATIVE_PREFILL_MAX has the measurements); 64 bounds its
# scratch.
CHUNK = 64


class QuickEngine:
    def __init__(self, model: QuickModel, lib, tokenizer, eos_token_ids: list[int], model_path: str):
        abi.declare_step(lib)
        self.model, self.lib, self.tokenizer = model, lib, tokenizer
        self.model_path, self.max_model_len = model_path, model.max_model_len
        self.output = OutputProcessor(tokenizer, set(eos_token_ids), model.max_model_len)
        self.threads = abi.ThreadChoice(int(os.environ.get("OMP_NUM_THREADS") or 1))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = None   # made on the first random draw (numpy.random costs an import a greedy run never needs)
        self._table = np.arange(model.num_blocks, dtype=np.int32)[None, :]   # the sequence's blocks, in order
        self._peak_blocks = 0

    # -- the Engine calls ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    @property
    def capacity_tokens(self) -> int:
        return self.model.num_blocks * self.model.block_size

    def check_prompt(self, ids: list[int]) -> None:
        """Engine.check_prompt's checks and errors, for this engine's one sequence."""
        if not ids:
            raise EmptyPrompt()
        if len(ids) >= self.max_model_len:
            raise ContextTooLong(len(ids), self.max_model_len)
        if len(ids) + 1 > self.capacity_tokens:
            raise PoolTooSmall(len(ids), self.capacity_tokens, self.model.num_blocks)
        if min(ids) < 0 or max(ids) >= self.model.vocab:
            raise RequestError(f"token ids must be in [0, {self.model.vocab})")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        assert takes(params), "the quick engine runs one unseeded (or greedy) sequence without extras"
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids)
        assert not self.requests, "the quick engine runs one request at a time"
        request_id = f"req-{next(self._ids)}"
        request = Request(request_id, ids, params)
        request.sequences.append(Sequence(request, 0, ids))
        request.prefix_hit_tokens = 0
        self.requests[request_id] = request
        return request_id

    def steps(self, request_ids: Iterable[str] | None = None) -> Iterator[list[TokenEvent]]:
        """Engine.steps for the one request: a step per prompt chunk (no events but the last's), then a step per
        token. Closed early, the request ends as aborted."""
        request = next(iter(self.requests.values()), None)
        if request is None:
            return
        seq = request.sequences[0]
        seq.status = SeqStatus.RUNNING
        try:
            while not seq.is_finished:
                yield self._step(seq)
        finally:
            if not seq.is_finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
                request.finish_time = time.perf_counter()

    def pop_output(self, request_id: str) -> RequestOutput:
        r = self.requests.pop(request_id)
        seq = r.sequences[0]
        ttft = r.first_token_time - r.arrival_time if r.first_token_time else None
        total = r.finish_time - r.arrival_time if r.finish_time else None
        return RequestOutput(r.request_id, r.prompt_token_ids,
                             [CompletionOutput(0, seq.output_ids, seq.text, seq.finish_reason, error=seq.error)], True,
                             0, ttft, total, r.error)

    def pool_stats(self) -> PoolStats:
        blocks = self.model.num_blocks
        return PoolStats(blocks, self.model.block_size, 0, blocks, 0, 0, self._peak_blocks, 0, 0, 0,
                         kv_dtype="float32")

    def stats(self):
        return SimpleNamespace(spec=None)   # what `run --json` reads of Engine.stats(): no speculation here

    def close(self) -> None:
        self.requests.clear()

    # -- a step ---------------------------------------------------------------------------------------------
    def _step(self, seq: Sequence) -> list[TokenEvent]:
        if seq.num_tokens > self.capacity_tokens:
            return [self._fail(seq)]
        start = seq.num_computed
        end = min(seq.num_tokens, start + CHUNK)
        logits = self._forward(seq.token_ids[start:end], start)
        seq.num_computed = end
        if end < seq.num_tokens:
            return []      # a prompt chunk before the last: nothing sampled
        if self._rng is None and seq.request.params.temperature > 0:
            self._rng = np.random.default_rng()
        token = pick(logits, seq.request.params, seq.token_ids, self._rng)
        return [self._append(seq, token)]

    def _forward(self, ids: list[int], start: int) -> np.ndarray:
        """decode.c's step over tokens at positions start.. (their K/V written into the pool): the last one's
        logits."""
        T = len(ids)
        self.model.prepare_positions(start + T)
        self._peak_blocks = max(self._peak_blocks, -(-(start + T) // self.model.block_size))
        tokens = np.asarray(ids, dtype=np.int64)
        positions = np.arange(start, start + T, dtype=np.int64)
        cu_seqlens = np.array([0, T], dtype=np.int32)
        rows = np.array([T - 1], dtype=np.int64)
        logits = np.empty((1, self.model.vocab), dtype=np.float32)
        threads = self.threads.pick(T)
        wall, cpu = time.perf_counter(), time.process_time()
        rc = self.lib.pc_step(self.model.struct, T, tokens.ctypes.data, positions.ctypes.data, 1,
                              cu_seqlens.ctypes.data, self._table.ctypes.data, self._table.shape[1],
                              logits.ctypes.data, threads, 1, rows.ctypes.data)
        self.threads.record(T, threads, time.perf_counter() - wall, time.process_time() - cpu)
        if rc != 0:
            raise MemoryError("native decode step: no memory for its scratch buffers")
        return logits[0]

    def _append(self, seq: Sequence, token: int) -> TokenEvent:
        request = seq.request
        now = time.perf_counter()
        request.first_token_time = request.first_token_time or now
        reason = self.output.append(seq, token)
        if reason is not None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            request.finish_time = now
        text = self.output.take_visible(seq, finished=reason is not None)
        return TokenEvent(request.request_id, 0, [token], text, reason)

    def _fail(self, seq: Sequence) -> TokenEvent:
        """The reply outgrew the pool: it ends with the engine's error for a sequence too large for its pool."""
        message = outgrew_pool(self.model.num_blocks, self.model.block_size)
        seq.status, seq.finish_reason, seq.error = SeqStatus.FINISHED, "error", message
        seq.request.error, seq.request.finish_time = message, time.perf_counter()
        return TokenEvent(seq.request.request_id, 0, [], "", "error", message)


def takes(params: SamplingParams) -> bool:
    """Whether a request is one this engine runs as the engine would: one sequence, greedy or unseeded (a seed
    promises the engine's random stream), no beams, log-probabilities, grammar or embedding."""
    return params.n == 1 and not params.beam_width and params.logprobs is None and params.prompt_logprobs is None \
        and params.grammar is None and not params.embed and (params.temperature == 0 or params.seed is None)
