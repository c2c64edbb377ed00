"""How much memory this machine can still give: the CPU pool and packed weights are sized by it."""

from __future__ import annotations

import ctypes
import ctypes.util
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


def libc() -> ctypes.CDLL | None:
    """The C library (madvise, malloc_trim), loaded once; None where it cannot be."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    return _LIBC


_LIBC: ctypes.CDLL | None = None


def give_back_free_heap() -> None:
    """Return the C heap's free memory to the system (glibc's malloc_trim; elsewhere nothing). Why: building a
    large vocabulary (Gemma 3's 262k tokens and their merges) frees tens of MB of temporaries that glibc
    keeps for reuse, and the big allocations that follow (the weight arena, the KV pool) are mapped apart
    from the heap, so that memory would stay resident for the life of the process (63 MB there)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
