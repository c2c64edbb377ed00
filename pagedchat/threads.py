"""CPU threads: how many torch uses (`--threads N`, PAGEDCHAT_THREADS, else the physical cores this process
may run on), and how idle ones wait.

Why the wait policy matters: OpenMP's default lets a thread that finished its share of an op spin for a
while before sleeping. Beside another busy process those spinning threads take the cores the working
thread needs, and batch-1 decode (hundreds of short ops per token) slowed 20-100x. Passive waiting puts
them to sleep at once. The OpenMP runtime reads the policy when it loads, so it is set before torch is
imported (`prepare_environment`, first thing in the CLI); a value the user set is kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "PAGEDCHAT_THREADS"


def prepare_environment() -> None:
    """Call before `import torch`: idle OpenMP threads sleep instead of spinning."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (hyper-threads share a core's arithmetic units,
    so a second thread per core adds contention, not speed)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology (containers, other systems): count logical CPUs
    return max(1, len(cores))


def resolve_threads(threads: int | None) -> int:
    """--threads, else $PAGEDCHAT_THREADS, else the physical cores."""
    from pagedchat.errors import UserError

    source = "--threads"
    if threads is None and os.environ.get(ENV_VAR, "").strip():
        source, raw = ENV_VAR, os.environ[ENV_VAR].strip()
        try:
            threads = int(raw)
        except ValueError:
            raise UserError(f"{ENV_VAR}={raw!r} is not a whole number of threads") from None
    if threads is None:
        return physical_cores()
    if threads < 1:
        raise UserError(f"{source} must be >= 1, got {threads}")
    return threads


def apply_threads(threads: int | None) -> int:
    """Set the intra-op thread count; returns it. Before torch is imported that is the environment its
    OpenMP runtime reads (commands that never touch torch do not pay for importing it); after, torch's own."""
    count = resolve_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(count)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
