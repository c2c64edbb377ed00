"""The engine: sequences, the block pool, the scheduler, sampling and the model runner.

Front ends (chat, run, serve) use `Engine`'s public methods and the types exported here, nothing else of
this package: see engine.py's docstring and docs/architecture.md."""

from pagedchat.engine.block_pool import BlockPool, PoolStats
from pagedchat.engine.config import EngineConfig, parse_size
from pagedchat.engine.engine import Engine
from pagedchat.engine.outputs import Branch, CompletionOutput, EngineStats, RequestOutput, TokenEvent
from pagedchat.engine.sampling_params import SamplingParams
from pagedchat.engine.sequence import Sequence

__all__ = ["BlockPool", "Branch", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PoolStats",
           "RequestOutput", "SamplingParams", "Sequence", "TokenEvent", "parse_size"]
