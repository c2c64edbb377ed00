"""The engine: sequences, the block pool, the scheduler, sampling and the model runner."""

from pagedchat.engine.block_pool import BlockPool, PoolStats
from pagedchat.engine.config import EngineConfig, parse_size
from pagedchat.engine.engine import CompletionOutput, Engine, EngineStats, RequestOutput, TokenEvent
from pagedchat.engine.sampling_params import SamplingParams
from pagedchat.engine.sequence import Sequence

__all__ = ["BlockPool", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PoolStats", "RequestOutput",
           "SamplingParams", "Sequence", "TokenEvent", "parse_size"]
