"""The engine: the one API the front ends use (`Engine`, engine.py) over three floors, each a folder:
`decoding/` (sampling, speculation, beams) over `core/` (requests, sequences, scheduler, runner) over `kv/`
(the block pool and its RAM and disk tiers). Arrows point down only; each folder's docstring says what it
may import.

Front ends (chat, run, serve) use `Engine`'s public methods and the types exported here, nothing else of
this package: see engine.py's docstring and docs/architecture.md.

The exports load on first use (PEP 562), so the command line can import the torch-free settings
(`core/config.py`, `core/sampling_params.py`) and refuse a bad flag before torch loads."""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "EngineConfig": "pagedchat.engine.core.config", "parse_size": "pagedchat.engine.core.config",
    "SamplingParams": "pagedchat.engine.core.sampling_params", "Sequence": "pagedchat.engine.core.sequence",
    "Engine": "pagedchat.engine.engine", "BlockPool": "pagedchat.engine.kv.block_pool",
    "PoolStats": "pagedchat.engine.kv.block_pool", "Branch": "pagedchat.engine.outputs",
    "CompletionOutput": "pagedchat.engine.outputs", "EngineStats": "pagedchat.engine.outputs",
    "RequestOutput": "pagedchat.engine.outputs", "TokenEvent": "pagedchat.engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value     # once loaded, a plain module attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
