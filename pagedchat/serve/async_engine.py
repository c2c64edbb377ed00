"""The engine behind the server: one thread drives Engine.steps(); HTTP handlers talk to it by commands.

The engine is not thread-safe, so every touch of it (add, abort, stats) is a command that the loop thread
runs between steps. The requests of one HTTP call form a RequestGroup; their token events come back to the
event loop on the group's asyncio queue via `call_soon_threadsafe`. Every request goes through the one
loop, so batching is continuous: a new request joins the running batch at the next step. When there is
nothing to do the thread sleeps on a condition variable (no busy-wait).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from contextlib import closing
from dataclasses import dataclass
from typing import Callable

from pagedchat.engine import Engine, RequestOutput, SamplingParams, TokenEvent
from pagedchat.serve.metrics import ServerMetrics

log = logging.getLogger("pagedchat.serve")
CHECKPOINT_INTERVAL_S = 30.0   # a server that never goes idle still saves its cached KV blocks this often


# -- what a group's queue carries (lists of these, one list per engine step) ----------------------------------
@dataclass
class Token:
    slot: int            # which prompt of the call
    event: TokenEvent


@dataclass
class Done:
    slot: int
    output: RequestOutput


@dataclass
class Failure:
    message: str
    status: int = 500
    code: str | None = None


class GroupFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


class RequestGroup:
    """The engine requests of one HTTP call. Iterate it (on the event loop) for Token and Done items."""

    _ids = itertools.count()

    def __init__(self, owner: "AsyncEngine", size: int):
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list] = asyncio.Queue()
        self.name = f"g{next(self._ids)}"
        self.request_ids: list[str | None] = [None] * size   # written by the loop thread
        self.outputs: list[RequestOutput | None] = [None] * size
        self.prompt_ids: list[list[int] | None] = [None] * size  # written by the loop thread when added
        self.complete = False

    async def __aiter__(self):
        pending = sum(o is None for o in self.outputs)
        while pending:
            for item in await self.queue.get():
                if isinstance(item, Failure):
                    self.complete = True          # the engine side already dropped its requests
                    raise GroupFailed(item)
                if isinstance(item, Done):
                    self.outputs[item.slot] = item.output
                    pending -= 1
                yield item
        self.complete = True

    def abort(self) -> None:
        """Stop this call's requests now and free their blocks (no-op once they finished). Never blocks, so
        it is safe in `finally` blocks of cancelled tasks."""
        if not self.complete:
            self.complete = True
            self.owner.submit(lambda engine: self.owner._abort_group(engine, self))
        self.owner._open.discard(self)

    def _push(self, items: list) -> None:
        """Called from the loop thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, items)
        except RuntimeError:      # the event loop is closed (server shut down): nobody is listening
            pass


class BlockingGroup:
    """The requests of a caller on another thread (a chat turn of the web page runs the chat layer in a worker
    thread): the same items as a RequestGroup, on a thread-safe queue. `stop()` wakes a waiting `get`."""

    STOP = object()
    _ids = itertools.count()

    def __init__(self, size: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.name = f"b{next(self._ids)}"
        self.request_ids: list[str | None] = [None] * size
        self.prompt_ids: list[list[int] | None] = [None] * size

    def get(self) -> list:
        return self.queue.get()

    def stop(self) -> None:
        """Any thread: the waiting consumer gets [BlockingGroup.STOP] next (it then calls AsyncEngine.stop_group)."""
        self.queue.put([self.STOP])

    def _push(self, items: list) -> None:
        self.queue.put(items)


@dataclass
class Counters:
    total: int = 0           # engine requests accepted
    aborted: int = 0         # stopped early because the client went away (or the server stopped)
    failed: int = 0          # ended by an error


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.counters = Counters()
        self.metrics = ServerMetrics()    # GET /metrics; recorded on the loop thread
        self._commands: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._slots: dict[str, tuple[RequestGroup, int]] = {}   # request id -> (group, slot); loop thread only
        self._open: set[RequestGroup] = set()                   # groups being served; event loop only
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._last_checkpoint = time.monotonic()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread; call it on the event loop that will serve the requests."""
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def close_open_groups(self, message: str = "the server is shutting down") -> None:
        """On the event loop: end every call being served with an error (used on Ctrl-C so that open
        streams finish at once instead of holding the shutdown)."""
        for group in list(self._open):
            group.queue.put_nowait([Failure(message, 503, "server_shutting_down")])
            group.abort()

    # -- commands (any thread) ------------------------------------------------------------------------------
    def submit(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread between two steps; its result arrives on the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                future.set_exception(RuntimeError("the engine loop has stopped"))
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    async def call(self, fn: Callable[[Engine], object]):
        return await asyncio.wrap_future(self.submit(fn))

    async def add(self, prompts: list[Callable[[Engine], list[int]]], params: SamplingParams) -> RequestGroup:
        """Queue one engine request per prompt (each a callable building token ids on the loop thread, where
        the tokenizer lives). Raises the engine's errors (too long, bad ids) before anything is queued."""
        group = RequestGroup(self, len(prompts))
        arrived = time.perf_counter()    # latencies count the wait for the step boundary too
        try:
            await self.call(lambda engine: self._add_group(engine, group, prompts, params, arrived))
        except asyncio.CancelledError:
            group.abort()       # the add may still run: the abort command is queued behind it
            raise
        self._open.add(group)
        return group

    # -- callers on other threads (the web page's chat turns) -----------------------------------------------
    def run(self, fn: Callable[[Engine], object]):
        """submit() and wait: for worker threads only (on the event loop it would block every client, on the
        loop thread it would wait for itself)."""
        assert threading.current_thread() is not self._thread, "run() on the engine loop thread would deadlock"
        assert self.loop is None or _not_on(self.loop), "run() on the event loop would block every client"
        return self.submit(fn).result()

    def add_blocking(self, prompt: list[int], params: SamplingParams, **request) -> BlockingGroup:
        """One engine request (add_request's keep/parent/context in `request`) whose items a worker thread
        reads with BlockingGroup.get(). Raises the engine's errors before anything is queued."""
        group = BlockingGroup(1)
        arrived = time.perf_counter()
        self.run(lambda engine: self._add_group(engine, group, [lambda _: prompt], params, arrived, request))
        return group

    def stop_group(self, group: BlockingGroup) -> list:
        """Stop a blocking group's unfinished requests now and return their outputs as they stand (partial
        replies, finish_reason "abort"; variants that already finished keep their pins)."""
        def stop(engine: Engine) -> list:
            outputs = []
            for rid in group.request_ids:
                if rid is not None and self._slots.pop(rid, None) is not None:
                    engine.abort(rid)
                    outputs.append(engine.pop_output(rid))
                    self.metrics.ended(rid, "abort")
                    self.counters.aborted += 1
            return outputs
        return self.run(stop)

    # -- the loop thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._run_commands()
                if self._drive():
                    self._checkpoint()      # gone idle: the new cached blocks go to the disk tier
            except Exception as e:  # a bug here must not leave every client waiting forever
                log.exception("engine loop error")
                self._fail_all(Failure(f"engine error: {type(e).__name__}: {e}", 500, "engine_error"))
        self._shutdown()

    def _run_commands(self) -> bool:
        """Run the queued commands; False once the loop is stopping."""
        with self._wake:
            commands, self._commands = self._commands, deque()
            stopping = self._stopping
        for fn, future in commands:
            self._run_command(fn, future)
        return not stopping

    def _run_command(self, fn, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return                      # the caller gave up before it ran
        try:
            future.set_result(fn(self.engine))
        except Exception as e:          # user errors travel back to the HTTP handler that asked
            future.set_exception(e)

    def _drive(self) -> bool:
        """Step the engine until it has no work, running the commands that arrive between two steps (so a
        new request joins the running batch at the next step). True when it stepped and ran out of work."""
        stepped = False
        try:
            with closing(self.engine.steps()) as steps:
                for events in steps:
                    stepped = True
                    self._dispatch(events)
                    if not self._run_commands():
                        return False    # stopping: _shutdown fails what is left
                    if time.monotonic() - self._last_checkpoint > CHECKPOINT_INTERVAL_S:
                        self._checkpoint()  # busy for long: do not wait for idle to save the cache
        except Exception as e:  # a bug or a device error: fail the calls in flight, keep serving
            log.exception("engine step failed")
            self._fail_all(Failure(f"engine error: {type(e).__name__}: {e}", 500, "engine_error"))
            return False
        return stepped

    def _checkpoint(self) -> None:
        """Queue the pool's new cached blocks for the disk tier (written by its own thread): a server killed
        without a clean shutdown then loses only what it cached since. A failure here costs only the cache."""
        self._last_checkpoint = time.monotonic()
        try:
            self.engine.checkpoint()
        except Exception:
            log.exception("saving the KV cache to disk failed")

    def _dispatch(self, events: list[TokenEvent]) -> None:
        batches: dict[RequestGroup, list] = {}
        ended: list[str] = []
        now = time.perf_counter()
        for event in events:
            owner = self._slots.get(event.request_id)
            if owner is None:
                continue
            self.metrics.tokens(event, now)
            group, slot = owner
            batches.setdefault(group, []).append(Token(slot, event))
            if event.finish_reason is not None:
                ended.append(event.request_id)
        for rid in dict.fromkeys(ended):
            if not self.engine.is_finished(rid) or rid not in self._slots:
                continue
            group, slot = self._slots.pop(rid)
            output = self.engine.pop_output(rid)
            self.counters.failed += output.error is not None
            self.metrics.done(output, now)
            batches.setdefault(group, []).append(Done(slot, output))
        for group, items in batches.items():
            group._push(items)

    def _add_group(self, engine: Engine, group, prompts, params: SamplingParams, arrived: float,
                   request: dict | None = None) -> None:
        token_ids = [prepare(engine) for prepare in prompts]   # template/tokenizer errors: nothing added yet
        try:
            for slot, ids in enumerate(token_ids):
                rid = engine.add_request(ids, params, request_id=f"{group.name}-{slot}", **(request or {}))
                group.request_ids[slot] = rid
                group.prompt_ids[slot] = ids
                self._slots[rid] = (group, slot)
                self.counters.total += 1
                self.metrics.started(rid, len(ids), arrived)
        except BaseException:
            self._drop(engine, group, reason=None)    # the call is refused whole: none of it counts as served
            raise

    def _abort_group(self, engine: Engine, group: RequestGroup) -> None:
        self.counters.aborted += self._drop(engine, group)

    def _drop(self, engine: Engine, group: RequestGroup, reason: str | None = "abort") -> int:
        """Abort and forget the group's live requests (frees their blocks); returns how many there were.
        reason: how /metrics counts their end (None: not at all)."""
        dropped = 0
        for rid in group.request_ids:
            if rid is not None and self._slots.pop(rid, None) is not None:
                engine.abort(rid)
                engine.pop_output(rid)
                self.metrics.ended(rid, reason)
                dropped += 1
        return dropped

    def _fail_all(self, failure: Failure) -> None:
        groups = {group for group, _ in self._slots.values()}
        for group in groups:
            try:
                self.counters.failed += self._drop(self.engine, group, reason="error")
            except Exception:
                log.exception("aborting after an engine error failed")
            group._push([failure])
        self._slots.clear()

    def _shutdown(self) -> None:
        with self._wake:
            commands, self._commands = self._commands, deque()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine loop has stopped"))
        self._fail_all(Failure("the server is shutting down", 503, "server_shutting_down"))
        self.engine.close()  # cached prompts (a shared system prompt) reach the disk tier for the next start


def _not_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is not loop
    except RuntimeError:
        return True
