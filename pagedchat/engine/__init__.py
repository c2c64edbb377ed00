"""The engine: the one API the front ends use (`Engine`, engine.py) over three floors, each a folder:
`decoding/` (sampling, speculation, beams) over `core/` (requests, sequences, scheduler, runner) over `kv/`
(the block pool and its RAM and disk tiers). Arrows point down only; each folder's docstring says what it
may import.

Front ends (chat, run, serve) use `Engine`'s public methods and the types exported here, nothing else of
this package: see engine.py's docstring and docs/architecture.md."""

from pagedchat.engine.core.config import EngineConfig, parse_size
from pagedchat.engine.core.sampling_params import SamplingParams
from pagedchat.engine.core.sequence import Sequence
from pagedchat.engine.engine import Engine
from pagedchat.engine.kv.block_pool import BlockPool, PoolStats
from pagedchat.engine.outputs import Branch, CompletionOutput, EngineStats, RequestOutput, TokenEvent

__all__ = ["BlockPool", "Branch", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PoolStats",
           "RequestOutput", "SamplingParams", "Sequence", "TokenEvent", "parse_size"]
