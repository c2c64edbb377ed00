"""How much memory this machine can still give: the CPU pool and packed weights are sized by it."""

from __future__ import annotations

import os


def available_ram() -> int:
    """Memory the pool can take without swapping: MemAvailable (free + reclaimable cache) where Linux says
    it, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
