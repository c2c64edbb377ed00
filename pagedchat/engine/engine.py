"""The engine API shared by `run`, the chat REPL and the server.

    engine = Engine(EngineConfig(model="path/to/hf-folder"))
    rid = engine.add_request("Hello", SamplingParams(temperature=0), keep=True)
    while engine.has_unfinished():
        for event in engine.step(): ...          # TokenEvent: new token ids and text per variant
    out = engine.pop_output(rid)                 # RequestOutput with every variant
    engine.add_request(out.outputs[0].token_ids_all + more, params, parent=out.outputs[0].handle)

Not thread-safe: one thread drives it (the server wraps it in a loop thread).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedchat.engine.block_pool import BlockPool, PoolStats
from pagedchat.engine.config import EngineConfig
from pagedchat.engine.detokenizer import decode_new_text
from pagedchat.engine.kv_tiers import KVTiers, build_tiers
from pagedchat.engine.runner import ModelRunner
from pagedchat.engine.sampler import Sampler, variant_generator
from pagedchat.engine.sampling_params import SamplingParams
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.sequence import Request, Sequence, SeqStatus
from pagedchat.errors import RequestError
from pagedchat.model.loader import LoadedModel, load_model


@dataclass
class TokenEvent:
    request_id: str
    index: int                 # variant
    token_ids: list[int]       # new this step
    text: str                  # new text this step (held back while it could still become a stop string)
    finish_reason: str | None = None   # stop | length | abort | error
    error: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    handle: Sequence | None = None     # pinned sequence (keep=True): pass as `parent` to continue from it
    error: str | None = None

    @property
    def token_ids_all(self) -> list[int]:
        """Prompt + output: the exact tokens a follow-up turn continues from."""
        return list(self.handle.token_ids) if self.handle is not None else []


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prefix_hit_tokens: int                 # prompt tokens whose KV was reused (any tier)
    ttft_s: float | None
    total_s: float | None
    error: str | None = None
    ram_hit_tokens: int = 0                # of prefix_hit_tokens: loaded from the host-RAM tier
    disk_hit_tokens: int = 0               # of prefix_hit_tokens: loaded from the disk tier

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineStats:
    pool: PoolStats
    running: int
    waiting: int
    pinned: int
    pinned_blocks: int
    preemptions: int
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, show_progress: bool = True,
                 runner=None, tiers: KVTiers | None = None):
        """`runner` replaces the model runner (property tests and memory benchmarks drive the real
        scheduling without a model); it needs `num_blocks` and `run(batch) -> (logits, sequences)`.
        `tiers` replaces the RAM/disk tiers the config asks for (tests give a fake runner its own)."""
        self.config = config
        self.loaded = loaded or load_model(config.model, config.device, config.dtype, config.max_model_len,
                                           trust_remote_code=config.trust_remote_code, show_progress=show_progress)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = set(self.loaded.eos_token_ids)
        self.max_model_len = self.loaded.max_model_len
        self.runner = runner or ModelRunner(self.loaded, config)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_cache)
        self.tiers = tiers if tiers is not None else self._build_tiers()
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.spill
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   reserve_upfront=config.kv_allocation == "reserved",
                                   max_model_len=self.max_model_len, tiers=self.tiers)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def _build_tiers(self) -> KVTiers | None:
        config = self.config
        if not config.enable_prefix_cache or not (config.kv_ram or config.kv_disk):
            return None
        from pagedchat.engine.kv_fingerprint import engine_fingerprint, kv_cache_root
        from pagedchat.model.loader import weight_files

        fp, meta = "", {}
        root = Path(config.kv_dir) if config.kv_dir else kv_cache_root()
        if config.kv_disk:
            extra = {"quantize": q} if (q := getattr(config, "quantize", None)) else None
            fp, meta = engine_fingerprint(self.loaded.path, weight_files(self.loaded.path), self.loaded.dtype,
                                          config.block_size, self.device.type, root, extra)
        return build_tiers(self.runner, self.runner.block_payload_shape, self.loaded.dtype, fp, config.kv_ram,
                           config.kv_disk, root, meta)

    # -- KV that outlives the process -----------------------------------------------------------------------
    def persist(self, handles: list[Sequence | None]) -> None:
        """Write the full blocks of these pinned branch heads through to the disk tier (a session save), so
        another process reopening the session loads them instead of prefilling."""
        if self.tiers is None:
            return
        bs, blocks = self.pool.block_size, []
        for h in handles:
            if h is not None and h.status == SeqStatus.PINNED:
                blocks += [(b, key, tuple(h.token_ids[i * bs:(i + 1) * bs]))
                           for i, (b, key) in enumerate(zip(h.block_table, h.block_hashes))]
        self.tiers.write_through(blocks)

    def close(self) -> None:
        """Write what the pool and the RAM tier hold to disk and wait for the writes. Call before exit."""
        if self.tiers is not None:
            self.tiers.close(self.pool.cached_blocks())

    # -- requests -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"model {self.loaded.path} has no tokenizer: pass token ids")
        return list(self.tokenizer(text).input_ids)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, keep: bool = False, parent: Sequence | None = None) -> str:
        """Queue a prompt (text is encoded raw, no template). keep=True pins each finished variant's blocks;
        parent= a pinned sequence whose tokens prefix this prompt: its KV is reused by forking it."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_fits(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids, params, keep=keep)
        seq = Sequence(request, 0, ids)
        seq.generator = variant_generator(params.seed, 0, self.device)
        seq.parent = parent if parent is not None and parent.status == SeqStatus.PINNED else None
        request.sequences.append(seq)
        request.forked = params.n == 1
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if params.n > self.scheduler.max_num_seqs:
            # variants all run at once: more than a step's sequences would only thrash the scheduler
            raise RequestError(f"{params.n} variants is more than the {self.scheduler.max_num_seqs} sequences the "
                               f"engine runs at once")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt is {len(ids)} tokens but the model's context is {self.max_model_len} "
                               f"tokens (at least one must be left to generate)")
        needed = self.scheduler.blocks_for(len(ids) + 1)
        if needed > self.pool.num_blocks:
            capacity = self.pool.num_blocks * self.pool.block_size
            raise RequestError(f"prompt is {len(ids)} tokens but the whole KV pool holds {capacity} tokens "
                               f"({self.pool.num_blocks} blocks); raise --kv-memory")
        vocab = self.loaded.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"token ids must be in [0, {vocab})")

    def fork(self, handle: Sequence, params: SamplingParams | None = None, keep: bool = False,
             request_id: str | None = None) -> str:
        """A new request continuing a running or pinned sequence from its current tokens. The child shares
        every block; the first write into the shared partial block copies that one block."""
        assert handle.status in (SeqStatus.RUNNING, SeqStatus.PINNED), f"cannot fork a {handle.status.value} sequence"
        params = (params or handle.request.params).with_(n=1)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, list(handle.token_ids), params, keep=keep, forked=True)
        child = Sequence(request, 0, handle.token_ids)
        child.block_table = self.pool.fork_table(handle.block_table)
        child.block_hashes = list(handle.block_hashes)
        child.num_computed = handle.num_computed
        child.generator = variant_generator(params.seed, 0, self.device)
        request.sequences.append(child)
        request.prefix_hit_tokens = child.num_computed
        self.requests[request_id] = request
        if handle.status == SeqStatus.PINNED:
            self.scheduler.touch_pin(handle)
        self.scheduler.add_running(child)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (pinned variants included)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.status == SeqStatus.PINNED:
                continue
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq, keep=False)
        request.forked = True
        request.finish_time = request.finish_time or time.perf_counter()

    def release(self, handle: Sequence | None) -> None:
        """Drop a pin (a conversation branch head that is no longer needed)."""
        if handle is not None:
            self.scheduler.evict_pin(handle)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        batch = self.scheduler.schedule()
        events = [self._fail(seq) for seq in batch.failed]
        if not batch:
            return events
        logits, samplers = self.runner.run(batch)
        self.scheduler.commit(batch)
        if logits is None:
            return events
        logits, samplers = self._fork_variants(logits, samplers)
        tokens = self.sampler(logits, samplers)
        now = time.perf_counter()
        for seq, token in zip(samplers, tokens):
            events.append(self._append_token(seq, token, now))
        return events

    def _fork_variants(self, logits: torch.Tensor, samplers: list[Sequence]):
        """After a prompt's prefill, its n variants become forks sharing every block of it."""
        rows, seqs = [], []
        for row, seq in enumerate(samplers):
            rows.append(row)
            seqs.append(seq)
            request = seq.request
            if request.forked:
                continue
            for index in range(1, request.params.n):
                child = Sequence(request, index, seq.token_ids)
                child.block_table = self.pool.fork_table(seq.block_table)
                child.block_hashes = list(seq.block_hashes)
                child.num_computed = seq.num_computed
                child.generator = variant_generator(request.params.seed, index, self.device)
                request.sequences.append(child)
                self.scheduler.add_running(child)
                rows.append(row)
                seqs.append(child)
            request.forked = True
        if len(rows) != len(samplers):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return logits, seqs

    def _append_token(self, seq: Sequence, token: int, now: float) -> TokenEvent:
        request, params = seq.request, seq.request.params
        request.first_token_time = request.first_token_time or now
        seq.token_ids.append(token)
        shown = len(seq.text)
        decode_new_text(self.tokenizer, seq)
        reason = None
        if not params.ignore_eos and token in self.eos_token_ids or token in params.stop_token_ids:
            reason = "stop"
        elif self._cut_at_stop_string(seq, shown):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq, keep=request.keep)
            if request.finished:
                request.finish_time = now
        # Hold back text that could still turn out to be the start of a stop string.
        held = 0 if reason or not params.stop else max(len(s) for s in params.stop) - 1
        visible = max(seq.emitted, len(seq.text) - held)
        text, seq.emitted = seq.text[seq.emitted:visible], visible
        return TokenEvent(request.request_id, seq.index, [token], text, reason)

    def _cut_at_stop_string(self, seq: Sequence, shown: int) -> bool:
        stops = seq.request.params.stop
        if not stops:
            return False
        window_start = max(0, shown - max(len(s) for s in stops))
        cut = min((i for i in (seq.text.find(s, window_start) for s in stops) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.text = seq.text[:cut]
        return True

    def _fail(self, seq: Sequence) -> TokenEvent:
        """One sequence that cannot fit even alone in the pool (the scheduler already freed it) fails alone:
        its sibling variants keep going, and may finish before they grow as large. They must not be failed
        here: they can be in this very step's batch, with blocks reserved."""
        request = seq.request
        message = (f"request needs more KV memory than the whole pool ({self.pool.num_blocks} blocks of "
                   f"{self.pool.block_size} tokens); raise --kv-memory")
        seq.finish_reason, seq.error = "error", message
        seq.status = SeqStatus.FINISHED
        request.error = request.error or message
        request.forked = True  # failed before its prefill ended: its other variants will never exist
        if request.finished:
            request.finish_time = time.perf_counter()
        return TokenEvent(request.request_id, seq.index, [], "", "error", message)

    # -- outputs --------------------------------------------------------------------------------------------
    def get_output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        outputs = [CompletionOutput(s.index, s.output_ids, s.text, s.finish_reason,
                                    s if s.status == SeqStatus.PINNED else None, s.error)
                   for s in sorted(r.sequences, key=lambda s: s.index)]
        ttft = r.first_token_time - r.arrival_time if r.first_token_time else None
        total = r.finish_time - r.arrival_time if r.finish_time else None
        return RequestOutput(r.request_id, r.prompt_token_ids, outputs, r.finished, r.prefix_hit_tokens or 0,
                             ttft, total, r.error, r.ram_hit_tokens, r.disk_hit_tokens)

    def pop_output(self, request_id: str) -> RequestOutput:
        out = self.get_output(request_id)
        if out.finished:
            del self.requests[request_id]
        return out

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 keep: bool = False) -> list[RequestOutput]:
        """Run prompts together to completion (continuous batching); results in input order."""
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, keep=keep) for p, sp in zip(prompts, param_list)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.pop_output(i) for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, keep: bool = False,
               parent: Sequence | None = None):
        """Yield this request's TokenEvents as they come; the final RequestOutput is the generator's return
        value. Closing the generator early (Ctrl-C, a client gone) aborts the request and frees its blocks."""
        rid = self.add_request(prompt, params, keep=keep, parent=parent)
        try:
            while not self.requests[rid].finished:
                for event in self.step():
                    if event.request_id == rid:
                        yield event
        finally:
            if not self.requests[rid].finished:
                self.abort(rid)
        return self.pop_output(rid)

    # -- stats ----------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pins = list(self.scheduler.pins.values())
        return EngineStats(self.pool.stats(), len(self.scheduler.running), len(self.scheduler.waiting), len(pins),
                           self.blocks_held(pins), self.scheduler.num_preemptions)

    def blocks_held(self, handles: list[Sequence]) -> int:
        """Distinct blocks held by these pinned sequences (what a session costs the pool)."""
        return len({b for h in handles if h is not None and h.status == SeqStatus.PINNED for b in h.block_table})

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.scheduler.all_tables())
