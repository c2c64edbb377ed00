"""The chat layer's backend inside `pagedchat serve`: the same ChatBackend the REPL uses, with every touch of the
engine run on the server's engine-loop thread (the engine is not thread-safe, and that thread is stepping it
for every other client). A chat turn runs in a worker thread and reads its tokens from a BlockingGroup, so a
browser's turn joins the same continuous batch as the OpenAI API's requests, on the same pool.
"""

from __future__ import annotations

import inspect
from types import FunctionType

from pagedchat.chat.backend import ChatBackend, ContextFull, Generated
from pagedchat.engine import SamplingParams
from pagedchat.errors import ContextTooLong, PoolTooSmall, UserError
from pagedchat.serve.async_engine import AsyncEngine, BlockingGroup, Done, Failure, Token
from pagedchat.settings import cli_words


class OnLoopThread:
    """The engine as ChatBackend reads it: its methods run on the loop thread and wait for the result; its
    plain attributes (tokenizer, max_model_len, eos ids: fixed at load) are read directly."""

    def __init__(self, aengine: AsyncEngine):
        self._aengine = aengine

    def __getattr__(self, name: str):
        engine = self._aengine.engine
        if not isinstance(inspect.getattr_static(type(engine), name, None), FunctionType):
            return getattr(engine, name)   # an attribute or property (the tokenizer is callable, yet not a method)
        return lambda *args, **kwargs: self._aengine.run(lambda e: getattr(e, name)(*args, **kwargs))


class ServedBackend(ChatBackend):
    def __init__(self, aengine: AsyncEngine):
        super().__init__(OnLoopThread(aengine))
        self.aengine = aengine
        self._group: BlockingGroup | None = None

    def stop(self) -> None:
        """Any thread (an HTTP handler): the running turn ends at the next step, its reply kept."""
        self.stop_requested = True
        group = self._group
        if group is not None:
            group.stop()

    def generate(self, prompt: list[int], params: SamplingParams, parent, on_update, context=None,
                 messages=None) -> Generated:
        try:
            group = self.aengine.add_blocking(prompt, params, keep=True, parent=parent, context=context)
        except ContextTooLong as e:
            raise ContextFull(f"the context is full: this turn needs {e.prompt_tokens} tokens and the model takes "
                              f"{e.max_model_len}", "start a new conversation, or continue from an earlier "
                              "message") from None
        except PoolTooSmall as e:
            raise UserError(cli_words(e)) from None
        self._group = group
        try:
            if self.stop_requested:     # stop() came before the group existed
                group.stop()
            out, interrupted = self._follow(group, on_update)
        finally:
            self._group = None
            self.stop_requested = False
        if out.error and not interrupted:
            self.aengine.run(lambda engine: [engine.release(v.handle) for v in out.outputs])
            raise UserError(out.error)
        return Generated(out, interrupted)

    def _follow(self, group: BlockingGroup, on_update):
        """Stream the group's tokens to on_update until it is done or stopped: (output, interrupted)."""
        texts: dict[int, str] = {}
        while True:
            for item in group.get():
                if item is BlockingGroup.STOP:
                    outputs = self.aengine.stop_group(group)
                    if outputs:
                        return outputs[0], True
                    continue            # it had finished already: its Done is on the queue
                if isinstance(item, Failure):
                    raise UserError(item.message)
                if isinstance(item, Done):
                    return item.output, False
                assert isinstance(item, Token)
                if item.event.text:
                    index = item.event.index
                    texts[index] = texts.get(index, "") + item.event.text
                    if on_update is not None:
                        on_update(index, texts[index])
