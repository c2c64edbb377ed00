"""Which path a step takes, the native one or torch's: decided by measuring both on this machine, never assumed.

Why: the native step is not faster everywhere. It was built on an AVX-512 machine and ran 0.35x the torch path
at 16 sequences on an AVX2 one; tile shapes per instruction set fixed that case, but how a CPU, a model's
shape, a thread count and a batch size meet is measured, not known in advance. So the native step is used for
a size of step only where it measured at least as fast as the torch path.

How: steps are grouped by their token count in powers of two (1, 2, 3-4, 5-8, 9-16, ...), whatever their kind:
a decode step of 6 sequences and a verify step of 6 tokens (speculative decoding's k + 1 tokens of one
sequence) make the same weight pass, which is most of a step's time, so they share a group (and a verify step,
whose drafts come and go, does not wait for trials of its own). The first steps of a group alternate the two
paths (the first step of each warms it up and is not counted), PathChoice.TRIALS timed steps each; the group
then keeps the path with the lower median time per token. The result is kept on disk beside the library
(`<library>.paths.json`, keyed by the model's shape, weight and pool formats and the thread count), so later
processes on this machine start decided; deleting the file measures again. The measurement costs a handful
of slower steps once per machine and model shape.

PAGEDCHAT_NATIVE=always skips the measurement and always takes the native step (the tests use it; so can a
benchmark of the native step alone); PAGEDCHAT_NATIVE=0 never does.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pagedchat.native.build import ENV_SWITCH


def always_native() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() == "always"


def group_of(tokens: int, seqs: int) -> str:
    """The group a step is measured in: its token count rounded up to a power of two (seqs: how many
    sequences they belong to; the kind of step does not change the group)."""
    return f"tokens<={1 << (tokens - 1).bit_length()}"


@dataclass
class _Trial:
    """The per-token times of one group's trial steps, per path (the warm-up step of each not counted)."""
    native: list[float] = field(default_factory=list)
    torch: list[float] = field(default_factory=list)
    warmed: set = field(default_factory=set)


class PathChoice:
    TRIALS = 3

    def __init__(self, store: Path | None, signature: str):
        """store: the JSON file decisions are kept in (None: this process only); signature: what the decisions
        hold for (model shape, formats, library)."""
        self.store, self.signature = store, signature
        self.decided: dict[str, dict] = self._load()
        self.trials: dict[str, _Trial] = {}

    def _key(self, tokens: int, seqs: int, threads: int) -> str:
        return f"{group_of(tokens, seqs)}/threads={threads}"

    def use_native(self, tokens: int, seqs: int, threads: int) -> bool:
        """Whether this step should take the native path (during a group's trial: whichever path is due)."""
        if always_native():
            return True
        key = self._key(tokens, seqs, threads)
        if key in self.decided:
            return self.decided[key]["use"] == "native"
        trial = self.trials.setdefault(key, _Trial())
        return len(trial.native) + ("native" in trial.warmed) <= len(trial.torch) + ("torch" in trial.warmed)

    def record(self, tokens: int, seqs: int, threads: int, native: bool, seconds: float) -> None:
        """One step's wall time on the path it took."""
        key = self._key(tokens, seqs, threads)
        if key in self.decided or always_native():
            return
        trial = self.trials.setdefault(key, _Trial())
        path = "native" if native else "torch"
        if path not in trial.warmed:
            trial.warmed.add(path)
            return
        getattr(trial, path).append(seconds / tokens)
        if len(trial.native) >= self.TRIALS and len(trial.torch) >= self.TRIALS:
            native_s, torch_s = statistics.median(trial.native), statistics.median(trial.torch)
            self.decided[key] = {"use": "native" if native_s <= torch_s else "torch",
                                 "native_ms_per_token": round(native_s * 1e3, 4),
                                 "torch_ms_per_token": round(torch_s * 1e3, 4)}
            del self.trials[key]
            self._save()

    # -- the file -------------------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict]:
        if self.store is None:
            return {}
        try:
            entry = json.loads(self.store.read_text()).get(self.signature, {})
        except (OSError, ValueError, AttributeError):
            return {}  # none yet, or damaged: measure again
        return {k: v for k, v in entry.items() if isinstance(v, dict) and v.get("use") in ("native", "torch")}

    def _save(self) -> None:
        """Merge this signature's decisions into the file, written atomically (another process may be writing
        its own: the last one wins, and at worst a group is measured again)."""
        if self.store is None:
            return
        try:
            data = json.loads(self.store.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[self.signature] = {**data.get(self.signature, {}), **self.decided}
        tmp = self.store.with_name(f"{self.store.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.store)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache: decisions stay in this process
