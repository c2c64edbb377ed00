"""The engine API shared by `run`, the chat REPL and the server: the only door into the engine floor.

    engine = Engine(EngineConfig(model="path/to/hf-folder"))
    rid = engine.add_request(ids, SamplingParams(temperature=0), keep=True)   # raises the typed fit errors
    with closing(engine.steps([rid])) as steps:      # THE step loop: one list of TokenEvents per step;
        for events in steps: ...                     # closing it early aborts what is unfinished
    out = engine.pop_output(rid)                     # RequestOutput with every variant
    branch = out.outputs[0].handle                   # a pinned Branch (keep=True)
    engine.add_request(branch.token_ids + more, params, keep=True, parent=branch)   # prefills only `more`
    engine.release(branch)                           # the branch is no longer needed

Front ends use only what is public here: add_request / fork / abort / is_finished / get_output / pop_output /
release, steps (or generate), check_prompt, stats / pool_stats / capacity_tokens / blocks_held, and the
tokenizer, eos_token_ids, max_model_len and model_path attributes. The pool, scheduler, requests and runner
are the engine's own. Not thread-safe: one thread drives it (the server wraps it in a loop thread).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Iterable, Iterator

import torch

from pagedchat.engine.decoding import beam
from pagedchat.engine.kv.block_pool import BlockPool, PoolStats
from pagedchat.engine.kv.caches import kv_dtype_name
from pagedchat.engine.core.config import EngineConfig
from pagedchat.engine.core.grammar import Grammars
from pagedchat.engine.core.inflight import InFlight
from pagedchat.engine.kv.tiers import KVTiers, build_tiers
from pagedchat.engine.core.logprobs import TokenLogprob, reduce_rows
from pagedchat.engine.core.output_processor import OutputProcessor
from pagedchat.engine.outputs import Branch, CompletionOutput, EngineStats, RequestOutput, TokenEvent
from pagedchat.engine.core.runner import ModelRunner, kv_bytes_per_block, release_device_memory
from pagedchat.engine.decoding.sampler import Sampler, variant_generator
from pagedchat.engine.core.sampling_params import SamplingParams
from pagedchat.engine.core.scheduler import ScheduledBatch, Scheduler
from pagedchat.engine.core.seams import ModelSource, StepRunner
from pagedchat.engine.core.sequence import PENDING, Request, Sequence, SeqStatus
from pagedchat.engine.core.step_inputs import index_tensor
from pagedchat.engine.core.window_groups import WindowTables
from pagedchat.engine.decoding.speculative import NgramProposer, Speculator, step_shape
from pagedchat.errors import (ContextTooLong, EmptyPrompt, PoolTooSmall, RequestError, TooManyVariants, UserError,
                              outgrew_pool)
from pagedchat.model.loader import load_model, resolve_device

__all__ = ["Branch", "CompletionOutput", "Engine", "EngineStats", "RequestOutput", "TokenEvent"]


log = logging.getLogger("pagedchat.engine")

class Engine:
    def __init__(self, config: EngineConfig, loaded: ModelSource | None = None, show_progress: bool = True,
                 runner: StepRunner | None = None, tiers: KVTiers | None = None):
        """`loaded` and `runner` replace the loaded model and the model runner (property tests and the
        memory benchmarks drive the real scheduling without a model): see engine/core/seams.py. `tiers` replaces
        the RAM/disk tiers the config asks for (tests give a fake runner its own)."""
        self.config = config
        if loaded is None:  # an unsupported --kv-dtype fails before the weights load
            config.check_kv_dtype(resolve_device(config.device).type)
        self.loaded = loaded or load_model(config.model, config.device, config.dtype, config.max_model_len,
                                           trust_remote_code=config.trust_remote_code, show_progress=show_progress,
                                           chat_template=config.chat_template, quantize=config.quantize)
        if loaded is None:
            self._weights_as_stored()
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = set(self.loaded.eos_token_ids)
        self.max_model_len = self.loaded.max_model_len
        self.draft = self._load_draft(config, show_progress)
        self.runner = runner or ModelRunner(self.loaded, config, self._draft_bytes_per_block(config))
        groups = getattr(self.runner, "kv_groups", None)
        windowed = groups is not None and groups.num_window_groups > 0
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_cache,
                              kv_dtype_name(config.kv_dtype, getattr(self.loaded, "dtype", None)))
        windows = WindowTables(self.pool, groups.num_window_groups, groups.window) if windowed else None
        # The RAM/disk tiers store whole blocks of the one global table: a sliding-window model's window
        # groups keep other blocks, which they do not store, so such models get no tiers (the pool's cache only).
        self.tiers = None if windowed else tiers if tiers is not None else self._build_tiers()
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.spill
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   reserve_upfront=config.kv_allocation == "reserved",
                                   max_model_len=self.max_model_len, windows=windows, tiers=self.tiers)
        self.sampler = Sampler()
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        # Overlapped steps (see step): the step whose tokens are still on the device, the token events that
        # settling it outside a step made (returned by the next step), and what overlapping did so far.
        self.overlap = config.overlaps(self.device.type)
        self._inflight: InFlight | None = None
        self._settled: list[TokenEvent] = []
        self.overlapped_steps = 0
        self.discarded_rows = 0   # rows computed for sequences that the previous step's tokens had ended
        self._speculators: dict[str, Speculator] = {}
        self.speculator: Speculator | None = None
        self.set_speculation(config.speculate)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._grammars: Grammars | None = None

    def _load_draft(self, config: EngineConfig, show_progress: bool) -> LoadedModel | None:
        if not config.draft_model:
            return None
        from pagedchat.engine.decoding.draft import load_draft

        return load_draft(config, self.loaded, show_progress)

    def _draft_bytes_per_block(self, config: EngineConfig) -> int:
        return kv_bytes_per_block(self.draft, config.block_size, config.kv_dtype) if self.draft is not None else 0

    def set_speculation(self, method: str) -> None:
        """Switch speculative decoding between steps: off, ngram, or draft (needs the config's draft model).
        A draft model is loaded once and kept."""
        self._settle_aside()  # drafts are proposed from the host's tokens
        if method == "off":
            self.speculator = None
            return
        if method not in ("ngram", "draft"):
            raise UserError(f"speculate must be ngram, draft or off, got {method!r}")
        if method == "draft" and self.draft is None:
            raise UserError("speculate draft needs a draft model: start with --draft-model NAME|PATH")
        if method not in self._speculators:
            if method == "ngram":
                proposer = NgramProposer()
            else:
                proposer = self._draft_proposer()
            self._speculators[method] = Speculator(method, self.config.num_draft_tokens, proposer,
                                                   self.max_model_len)
        self.speculator = self._speculators[method]

    def _draft_proposer(self):
        """The draft model's proposer, its KV in this engine's pool (engine/decoding/draft.py)."""
        from pagedchat.engine.decoding.draft import DraftProposer, draft_runner

        runner = draft_runner(self.draft, self.config, self.runner)
        return DraftProposer(runner, self.scheduler, self.runner.copy_blocks, self.loaded.spec.vocab_size,
                             self.draft.max_model_len)

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def _weights_as_stored(self) -> None:
        """A GGUF's block formats stay as stored where something multiplies them so: on CUDA (the Triton
        kernels; a format they lack is dequantized a layer at a time as it runs) and where the native CPU step
        runs the model. Elsewhere the torch
        path would dequantize every weight at every step (Gemma 3 270M on the torch path: 0.4 tok/s), so they are dequantized
        once, now, with a one-line note."""
        from pagedchat.model.gguf.load import dequantize_linears
        from pagedchat.native.step import runs_gguf_as_stored

        loaded = self.loaded
        if loaded.device.type == "cuda" or runs_gguf_as_stored(loaded.model, loaded.dtype):
            return
        if dequantize_linears(loaded.model, loaded.dtype):
            log.warning("pagedchat: %s: weights dequantized to %s at load (no kernel here runs this model's "
                        "formats as stored; dequantizing them at every step would be far slower)",
                        Path(loaded.path).name, str(loaded.dtype).removeprefix("torch."))

    @property
    def model_path(self):
        """The model folder (for messages)."""
        return self.loaded.path

    def _build_tiers(self) -> KVTiers | None:
        config = self.config
        if not config.enable_prefix_cache or not (config.kv_ram or config.kv_disk):
            return None
        from pagedchat.engine.kv.fingerprint import engine_fingerprint, kv_cache_root
        from pagedchat.model.loader import weight_files

        fp, meta = "", {}
        root = Path(config.kv_dir) if config.kv_dir else kv_cache_root()
        if config.kv_disk:
            extra = {"quantize": q} if (q := getattr(config, "quantize", None)) not in (None, "none") else None
            fp, meta = engine_fingerprint(self.loaded.path, weight_files(self.loaded.path), self.loaded.dtype,
                                          config.block_size, self.device.type, root, extra, self.pool.kv_dtype)
        return build_tiers(self.runner, self.runner.block_payload_shape, self.runner.block_payload_dtype, fp,
                           config.kv_ram, config.kv_disk, root, meta)

    # -- KV that outlives the process -----------------------------------------------------------------------
    def persist(self, handles: Iterable[Branch | Sequence | None]) -> None:
        """Write the full blocks of these pinned branch heads through to the disk tier (a session save), so
        another process reopening the session loads them instead of prefilling."""
        if self.tiers is None:
            return
        bs, blocks = self.pool.block_size, []
        for h in map(_sequence, handles):
            if h is not None and h.status == SeqStatus.PINNED:
                blocks += [(b, key, tuple(h.token_ids[i * bs:(i + 1) * bs]))
                           for i, (b, key) in enumerate(zip(h.block_table, h.block_hashes))]
        self.tiers.write_through(blocks)

    def checkpoint(self) -> None:
        """Queue the cached blocks the disk tier lacks for writing, without waiting (a server calls this when
        it goes idle and every so often, so a killed server loses little of its cache)."""
        if self.tiers is not None:
            self.tiers.checkpoint(self.pool.cached_blocks())

    def close(self) -> None:
        """Call before exit, or before another engine takes the device: write what the pool and the RAM tier
        hold to disk (waiting for the writes), then give back what the engine took: the KV pool, the CUDA
        graphs and their memory, its references to the model (the model's memory too when nothing else holds
        it: a model passed in as `loaded` stays its owner's) and the allocator's cached memory. The engine
        cannot run afterwards; a second close does nothing."""
        if self.runner is None:
            return
        self._inflight = None   # its tokens are not wanted: the requests end with the engine
        if self.tiers is not None:
            self.tiers.close(self.pool.cached_blocks())
        device = self.device
        close_runner = getattr(self.runner, "close", None)   # a model-free runner holds nothing to give back
        if close_runner is not None:
            close_runner()
        self.requests.clear()
        self._speculators.clear()
        self.speculator = self.runner = self.tiers = self.draft = self.loaded = None
        release_device_memory(device)

    # -- requests -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"model {self.loaded.path} has no tokenizer: pass token ids")
        return list(self.tokenizer(text).input_ids)

    def grammars(self) -> Grammars:
        """The structured-output backend, built on first use (it loads llguidance and wraps the tokenizer)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.loaded.spec.vocab_size, self.eos_token_ids)
        return self._grammars

    def _matcher(self, params: SamplingParams, inherit: Sequence | None = None):
        """The grammar state a new sequence starts in: a copy of `inherit`'s when it follows the same grammar."""
        if params.grammar is None:
            return None
        if inherit is not None and inherit.matcher is not None and inherit.request.params.grammar == params.grammar:
            return inherit.matcher.deep_copy()
        return self.grammars().matcher(params.grammar)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, keep: bool = False, parent: Branch | None = None,
                    context: list[list[int]] | None = None) -> str:
        """Queue a prompt (text is encoded raw, no template) after `check_prompt`. keep=True pins each
        finished variant's blocks (its output's `handle`); parent= a Branch whose tokens prefix this prompt:
        its KV is reused by forking it (ignored once the engine dropped its pin). context= related token
        streams (sibling replies, other branches) that n-gram drafts may copy from."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, max(params.n, params.beam_width))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        matcher = self._matcher(params)          # an unsupported grammar fails here, before anything is queued
        request = Request(request_id, ids, params, keep=keep, context=list(context or []))
        seq = Sequence(request, 0, ids)
        seq.matcher = matcher
        seq.generator = variant_generator(params.seed, 0, self.device)
        pinned = _sequence(parent)
        seq.parent = pinned if pinned is not None and pinned.status == SeqStatus.PINNED else None
        request.sequences.append(seq)
        request.forked = params.n == 1
        if params.beam_width:
            request.beam = self._beam_search(request)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def _beam_search(self, request: Request) -> beam.BeamSearch:
        params = request.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        max_length = min(request.num_prompt_tokens + params.max_tokens, self.max_model_len)
        search = beam.BeamSearch(request, stop_ids, max_length, self.tokenizer)
        search.beams = list(request.sequences)
        return search

    def check_prompt(self, ids: list[int], n: int = 1) -> None:
        """Every check that a prompt can be served, in one place; raises EmptyPrompt, TooManyVariants,
        ContextTooLong, PoolTooSmall (typed, with the numbers, for each front end to word) or RequestError
        (token ids outside the vocabulary)."""
        if not ids:
            raise EmptyPrompt()
        if n > self.scheduler.max_num_seqs:
            # variants all run at once: more than a step's sequences would only thrash the scheduler
            raise TooManyVariants(n, self.scheduler.max_num_seqs)
        if len(ids) >= self.max_model_len:
            raise ContextTooLong(len(ids), self.max_model_len)
        if self.scheduler.blocks_for(len(ids) + 1) > self.pool.num_blocks:
            raise PoolTooSmall(len(ids), self.capacity_tokens, self.pool.num_blocks)
        vocab = self.loaded.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"token ids must be in [0, {vocab})")

    def fork(self, source: Branch | Sequence, params: SamplingParams | None = None, keep: bool = False,
             request_id: str | None = None) -> str:
        """A new request continuing a running or pinned sequence from its current tokens. The child shares
        every block; the first write into the shared partial block copies that one block."""
        handle = _sequence(source)
        assert handle.status in (SeqStatus.RUNNING, SeqStatus.PINNED), f"cannot fork a {handle.status.value} sequence"
        self._settle_aside()  # the child copies the parent's tokens: all of them known
        params = (params or handle.request.params).with_(n=1, beam_width=0, prompt_logprobs=None, embed=False)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, list(handle.token_ids), params, keep=keep, forked=True)
        # a beam waiting for its siblings has its last token's KV too: the child recomputes that token for
        # its own logits, so it shares only the blocks of the tokens before it (no block past its computed ones)
        child = self._fork_sequence(handle, request, 0, computed=min(handle.num_computed, handle.num_tokens - 1))
        request.prefix_hit_tokens = child.num_computed
        self.requests[request_id] = request
        if handle.status == SeqStatus.PINNED:
            self.scheduler.touch_pin(handle)
        self.scheduler.add_running(child)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (variants already pinned stay pinned: release them)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.status == SeqStatus.PINNED:
                continue
            if not seq.is_finished:
                if seq.pending_row is not None:
                    seq.drop_pending()
                seq.finish_reason = "abort"
                self.scheduler.finish(seq, keep=False)
        request.forked = True
        request.finish_time = request.finish_time or time.perf_counter()

    def is_finished(self, request_id: str) -> bool:
        """True once every variant ended (stop, length, abort, error); also for an id already popped."""
        request = self.requests.get(request_id)
        return request is None or request.finished

    def release(self, handle: Branch | Sequence | None) -> None:
        """Drop a pin (a conversation branch head that is no longer needed)."""
        seq = _sequence(handle)
        if seq is not None:
            self.scheduler.evict_pin(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- driving it -----------------------------------------------------------------------------------------
    def steps(self, request_ids: Iterable[str] | None = None) -> Iterator[list[TokenEvent]]:
        """THE step loop (run, the chat turn, the server loop and `generate` all drive the engine with it).

        Steps while any of `request_ids` is unfinished (None: while the engine has any work) and yields each
        step's TokenEvents, only those of `request_ids` when given (a list, possibly empty: a prefill chunk
        makes no token). Between two yields the caller may add, abort and pop requests. Closing the
        generator before the end (break + close, Ctrl-C, an error, a client gone) aborts the requests still
        unfinished, `request_ids` or every one, and frees their blocks: use `with closing(engine.steps(..))`.
        """
        ids = None if request_ids is None else list(request_ids)
        wanted = None if ids is None else set(ids)
        ended = False
        try:
            while True:
                if self._settled:  # tokens an API call between steps brought to the host
                    events, self._settled = self._settled, []
                elif self.has_unfinished() and (ids is None or not all(self.is_finished(r) for r in ids)):
                    events = self.step()
                else:
                    break
                yield events if wanted is None else [e for e in events if e.request_id in wanted]
            ended = True
        finally:
            if not ended:
                for rid in list(self.requests) if ids is None else ids:
                    if not self.is_finished(rid):
                        self.abort(rid)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 keep: bool = False) -> list[RequestOutput]:
        """Run prompts together to completion (continuous batching); results in input order."""
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, keep=keep) for p, sp in zip(prompts, param_list)]
        with closing(self.steps(ids)) as steps:
            for _ in steps:
                pass
        return [self.pop_output(i) for i in ids]

    def step(self) -> list[TokenEvent]:
        """One scheduled batch through the model; its token events. Callers drive it through `steps`.

        Overlapped (`self.overlap`: on a GPU unless turned off): a step's tokens stay on the device, where the
        next step reads them as its input ids, so the host schedules and launches step N+1 before it waits for
        step N's tokens, then appends them, detokenizes and checks stop rules while N+1 runs. Each sequence
        meanwhile ends in a PENDING token (Sequence.pending_row); a step's events are those of the tokens it
        settled, one step later. A sequence the settled token ended had a row in the running step: computed
        and dropped. Steps that need their tokens on the host before the next (beams, grammars, logprobs, a
        prompt's first n variants, speculation) are not overlapped."""
        events, self._settled = self._settled, []
        if self.speculator is None:
            return events + self._step(self.scheduler.schedule())
        events += self._settle()  # drafts are proposed from the host's tokens
        clock = self._step_clock
        started = clock()  # speculation learns what its steps cost (the batch-aware draft budget)
        self.speculator.propose(self.scheduler.running, closed=not self.scheduler.waiting)
        batch = self.scheduler.schedule()
        shape = step_shape(batch)
        events += self._step(batch)
        if batch:
            self.speculator.observe_step(shape, clock() - started)
        return events

    @property
    def _step_clock(self):
        """On CPU the process's CPU time: the work a step costs, not how long a busy machine made it wait.
        On a GPU the wall clock (the step ends with the logits on the host)."""
        return time.process_time if self.device.type == "cpu" else time.perf_counter

    def _step(self, batch: ScheduledBatch) -> list[TokenEvent]:
        events = [self._fail(seq) for seq in batch.failed]
        prior = self._inflight
        batch.prior_tokens = prior.tokens if prior is not None else None
        logits, samplers = self.runner.run(batch) if batch else (None, [])
        ahead = self._sample_ahead(logits, samplers) if logits is not None and self._overlaps(samplers) else None
        events += self._settle()  # the previous step's tokens, while this one runs on the device
        self.scheduler.commit(batch)
        # A failed beam ends its whole search, after the forward: its siblings may be in this very batch.
        events += [e for seq in batch.failed if seq.request.beam for e in self._end_beam_search(seq.request)]
        if ahead is not None:
            self._place_pending(ahead)
            return events
        if logits is None:
            return events
        if prior is not None:
            logits, samplers = self._drop_ended(logits, samplers)
        drafted = logits
        logits, samplers, verified = self._split_drafted(logits, samplers)
        now = time.perf_counter()
        if samplers:
            logits, samplers = self._fork_variants(logits, samplers)
            logits, samplers = self._advance_beams(logits, samplers, events)
        if samplers:
            scores = self.sampler.scores(logits, samplers)
            matchers = [s.matcher for s in samplers]
            allowed = self.grammars().mask(scores, matchers) if any(m is not None for m in matchers) else scores
            tokens = self.sampler.pick(allowed, samplers)
            logprobs = self._token_logprobs(scores, samplers, tokens)
            for seq, token, logprob in zip(samplers, tokens, logprobs):
                if seq.spec is not None:
                    self.speculator.record(seq, 0, 0, 1)
                events.append(self._append_tokens(seq, [token], now, logprob=logprob))
        if verified:   # never a logprobs request: those do not speculate
            drafted = self._mask_drafted(drafted, verified)
            for (seq, _, _), (tokens, accepted) in zip(verified, self.speculator.verify(drafted, verified)):
                events.append(self._append_tokens(seq, tokens, now, accepted))
        return events

    # -- overlapped steps (see step) -------------------------------------------------------------------------
    def _overlaps(self, samplers: list[Sequence]) -> bool:
        """Whether this step's tokens may stay on the device: nothing in it needs them on the host first."""
        return self.overlap and self.speculator is None and all(   # (drafts exist only with a speculator)
            seq.request.forked and not seq.request.samples_on_host for seq in samplers)

    def _sample_ahead(self, logits: torch.Tensor, samplers: list[Sequence]) -> InFlight:
        tokens = self.sampler.pick_on_device(self.sampler.scores(logits, samplers), samplers)
        self.overlapped_steps += 1
        return InFlight.start(samplers, tokens)

    def _place_pending(self, ahead: InFlight) -> None:
        """Each sequence still running ends in a PENDING token until the next step settles it."""
        for row, seq in enumerate(ahead.seqs):
            if seq.is_finished:   # the token settled in this step ended it: its row is not wanted
                self.discarded_rows += 1
                continue
            seq.token_ids.append(PENDING)
            seq.pending_row = row
            seq.ends_when_settled = self.output.ends_by_length(seq)   # the scheduler gives it no more rows
        self._inflight = ahead

    def _settle(self) -> list[TokenEvent]:
        """Wait for the in-flight step's tokens and append them (text, stop rules, finishing): its events."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        tokens = inflight.wait()
        now = time.perf_counter()
        events = []
        for seq in inflight.seqs:
            if seq.pending_row is not None:  # else it ended meanwhile (aborted, failed)
                token = tokens[seq.pending_row]
                seq.drop_pending()
                events.append(self._append_tokens(seq, [token], now))
        return events

    def _settle_aside(self) -> None:
        """Settle now (an API call that needs every token on the host); the next step returns the events."""
        self._settled += self._settle()

    def _drop_ended(self, logits: torch.Tensor, samplers: list[Sequence]):
        """The rows of sequences that settling the previous step ended, taken out before sampling."""
        keep = [i for i, seq in enumerate(samplers) if not seq.is_finished]
        if len(keep) == len(samplers):
            return logits, samplers
        assert not any(seq.draft_ids for seq in samplers), "speculative steps are never overlapped"
        self.discarded_rows += len(samplers) - len(keep)
        return logits[index_tensor(keep, logits.device)], [samplers[i] for i in keep]

    def _token_logprobs(self, scores: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list:
        """Each chosen token's log-probability and top alternatives, for the rows that ask (else None)."""
        rows = [i for i, s in enumerate(seqs) if s.request.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return out
        k = max(seqs[i].request.params.logprobs for i in rows)
        index = torch.tensor(rows, device=scores.device)
        chosen = torch.tensor([tokens[i] for i in rows], device=scores.device)
        for i, reduced in zip(rows, reduce_rows(scores[index], chosen, k)):
            reduced.top = reduced.top[:seqs[i].request.params.logprobs]
            out[i] = reduced
        return out

    def _mask_drafted(self, logits: torch.Tensor, verified: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """The drafted rows of grammar-constrained sequences masked by the grammar (Grammars.mask_drafted)."""
        constrained = [(seq, first, n) for seq, first, n in verified if seq.matcher is not None]
        if not constrained:
            return logits
        logits = logits.clone()  # the runner's logits are inference tensors: no in-place update on them
        for seq, first, n in constrained:
            logits[first:first + n] = self.grammars().mask_drafted(logits[first:first + n], seq.draft_ids,
                                                                   seq.matcher)
        return logits

    @staticmethod
    def _split_drafted(logits: torch.Tensor, samplers: list[Sequence]):
        """Separate plain rows (one per sequence) from the 1 + k rows of each sequence with drafts
        (verified: (sequence, first row, rows) into `logits`)."""
        if not any(seq.draft_ids for seq in samplers):
            return logits, samplers, []
        rows, plain, verified, r = [], [], [], 0
        for seq in samplers:
            n = 1 + len(seq.draft_ids)
            if n == 1:
                rows.append(r)
                plain.append(seq)
            else:
                verified.append((seq, r, n))
            r += n
        if not rows:
            return logits[:0], plain, verified
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], plain, verified

    def _fork_sequence(self, parent: Sequence, request: Request, index: int, computed: int | None = None) -> Sequence:
        """A child sharing the blocks of parent's first `computed` tokens (default: all it computed; refcount
        + 1 each); its own sampling stream."""
        child = Sequence(request, index, parent.token_ids)
        if computed is None or computed >= parent.num_computed:
            self.scheduler.fork_into(parent, child)
        elif self.scheduler.reserve_upfront:    # a reserved table keeps the whole reply's blocks
            self.scheduler.fork_into(parent, child)
            child.num_computed, child.block_hashes = computed, child.block_hashes[:computed // self.pool.block_size]
        else:
            self.scheduler.fork_into(parent, child, computed)
        child.generator = variant_generator(request.params.seed, index, self.device)
        child.matcher = self._matcher(request.params, inherit=parent)
        request.sequences.append(child)
        return child

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
                child = self._fork_sequence(seq, request, index)
                self.scheduler.add_running(child)
                rows.append(row)
                seqs.append(child)
            request.forked = True
        if len(rows) != len(samplers):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return logits, seqs

    def _advance_beams(self, logits: torch.Tensor, samplers: list[Sequence], events: list[TokenEvent]):
        """Hand beam rows to their searches; a search whose beams all have logits takes its step. Returns
        the rows left for the sampler."""
        rows = [i for i, seq in enumerate(samplers) if seq.request.beam is None]
        if len(rows) == len(samplers):
            return logits, samplers
        stepped = []
        for i, seq in enumerate(samplers):
            search = seq.request.beam
            if search is not None and not seq.is_finished:
                search.offer(seq, logits[i])
                if search.is_ready() and search not in stepped:
                    stepped.append(search)
        for search in stepped:
            request = search.request
            request.first_token_time = request.first_token_time or time.perf_counter()
            picks = search.select()
            if search.done:
                events += self._end_beam_search(request)
            else:
                search.beams = request.sequences = beam.next_beams(search, picks, self.scheduler)
        keep = torch.tensor(rows, device=logits.device, dtype=torch.long)
        return logits[keep], [samplers[i] for i in rows]

    def _end_beam_search(self, request: Request) -> list[TokenEvent]:
        """Free every live beam; the finished hypotheses (best first) become the request's outputs."""
        search = request.beam
        if not search.beams:
            return []  # already ended (two beams of one request can fail in the same step)
        for seq in search.beams:
            if not seq.is_finished:
                seq.finish_reason = "error" if request.error else "stop"
                self.scheduler.finish(seq, keep=False)
        request.finish_time = time.perf_counter()
        if request.error:  # the failing beam's own event already said so
            for seq in search.beams:
                seq.status, seq.error = SeqStatus.FINISHED, request.error
            request.sequences, search.beams = search.beams, []
            return []
        request.sequences, search.beams = search.results(), []
        return [TokenEvent(request.request_id, s.index, s.output_ids, s.text, s.finish_reason, s.error)
                for s in request.sequences]

    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float, accepted: int | None = None,
                       logprob: TokenLogprob | None = None) -> TokenEvent:
        """Append sampled tokens (several after a verified draft run) until one of them finishes the sequence.
        accepted: how many of them are drafts whose KV the step wrote; the pool is rolled back to those
        before the sequence can finish, be pinned or be forked. logprob: the one sampled token's, if asked."""
        request, params = seq.request, seq.request.params
        request.first_token_time = request.first_token_time or now
        if logprob is not None:
            seq.logprobs.append(logprob)
        start, reason, added = seq.num_tokens, None, []
        for token in tokens:
            added.append(token)
            reason = self.output.append(seq, token)
            if reason is not None:
                break
        if accepted is not None:
            seq.draft_ids = []
            seq.num_computed = start + min(len(added) - 1, accepted)  # the last token is never computed
            self.scheduler.roll_back(seq)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq, keep=request.keep)
            if request.finished:
                request.finish_time = now
        text = self.output.take_visible(seq, finished=reason is not None)
        prompt_logprobs = list(request.prompt_logprobs) \
            if params.prompt_logprobs is not None and seq.num_output_tokens == 1 else None
        return TokenEvent(request.request_id, seq.index, added, text, reason,
                          logprobs=None if logprob is None else [logprob], prompt_logprobs=prompt_logprobs)

    def _fail(self, seq: Sequence) -> TokenEvent:
        """One sequence that cannot fit even alone in the pool (the scheduler already freed it) fails alone:
        its sibling variants keep going, and may finish before they grow as large. They must not be failed
        here: they can be in this very step's batch, with blocks reserved."""
        request = seq.request
        if seq.pending_row is not None:
            seq.drop_pending()
        message = outgrew_pool(self.pool.num_blocks, self.pool.block_size)
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
        wants_logprobs = r.params.logprobs is not None
        outputs = [CompletionOutput(s.index, s.settled_output_ids, s.text, s.finish_reason,
                                    Branch(s) if s.status == SeqStatus.PINNED else None, s.error,
                                    score=s.score, logprobs=list(s.logprobs) if wants_logprobs else None)
                   for s in sorted(r.sequences, key=lambda s: s.index)]
        ttft = r.first_token_time - r.arrival_time if r.first_token_time else None
        total = r.finish_time - r.arrival_time if r.finish_time else None
        prompt_logprobs = list(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None
        embedding = (r.hidden_sum / r.pooled).float().tolist() if r.params.embed and r.pooled else None
        return RequestOutput(r.request_id, r.prompt_token_ids, outputs, r.finished, r.prefix_hit_tokens or 0,
                             ttft, total, r.error, prompt_logprobs, embedding, r.ram_hit_tokens,
                             r.disk_hit_tokens)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output; a finished request is forgotten (its id can be reused)."""
        out = self.get_output(request_id)
        if out.finished:
            del self.requests[request_id]
        return out

    # -- capacity and stats ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.pool.num_blocks * self.pool.block_size

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    def stats(self) -> EngineStats:
        pins = [Branch(s) for s in self.scheduler.pins.values()]
        return EngineStats(self.pool.stats(), len(self.scheduler.running), len(self.scheduler.waiting), len(pins),
                           self.blocks_held(pins), self.scheduler.num_preemptions,
                           spec=self.speculator.stats.as_dict() if self.speculator is not None else None)

    def blocks_held(self, handles: Iterable[Branch | Sequence | None]) -> int:
        """Distinct blocks held by these pinned branches (what a session costs the pool)."""
        return self.block_sharing(handles)[0]

    def block_sharing(self, handles: Iterable[Branch | Sequence | None]) -> tuple[int, int]:
        """(distinct blocks these pinned branches hold, how many of them two or more of the branches hold):
        what a conversation's branches cost the pool, and what they share instead of copying."""
        seqs = [_sequence(h) for h in handles]
        pinned = [s for s in seqs if s is not None and s.status == SeqStatus.PINNED]
        holders = Counter(b for s in pinned for b in {b for t in [s.block_table, *WindowTables.live_tables(s)]
                                                       for b in t})
        return len(holders), sum(1 for n in holders.values() if n > 1)

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.scheduler.all_tables())
        draft = self._speculators.get("draft")
        if draft is not None:
            draft.proposer.check_invariants(self.pool)


def _sequence(handle: Branch | Sequence | None) -> Sequence | None:
    """Engine code and white-box tests hold Sequences; front ends hold Branches."""
    return handle.sequence if isinstance(handle, Branch) else handle
