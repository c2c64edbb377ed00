"""Compile decode.c with the machine's C compiler once, into the user's cache; later processes load the cached
library (ctypes: no Python headers, no torch headers, a ~1 s build).

Built for this CPU (-march=native), named by a hash of the source, the flags and the CPU's model and flags, so
a changed source or another machine sharing the cache never loads a stale or foreign build.

The first process that finds no build does not wait for one: it starts the compiler in a detached process and
goes on with the torch path (a one-shot `run` must not pay a second of compiling; a REPL or server picks the
library up once it appears, engine/core/runner.py). That process builds under a private name and renames the result
into place, so a reader never loads half a library; a marker keeps a second process from starting the same
build, and a failed build leaves its error beside the target instead of being retried by every process.

A cached library is checked before it is loaded: the build writes its size and SHA-256 beside it (`.sum`),
and a library that does not match (truncated by a full disk, damaged, or built before records were kept) is
never handed to the dynamic loader, which maps it and dies of SIGBUS on the first missing page. It is
deleted and rebuilt, with one warning line; the run goes on on the torch path meanwhile.

The target flags are `-march=native` unless PAGEDCHAT_NATIVE_CFLAGS gives others: `-march=haswell` measures the
AVX2 build on an AVX-512 machine, `-DPC_ISA_GENERIC` forces the portable tiles (decode.c says which exist).

No compiler, a failed build or PAGEDCHAT_NATIVE=0: `load()` returns None and the torch path stays; `status()`
says why in one line.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedchat import dirs

SOURCE = Path(__file__).with_name("decode.c")
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-fvisibility=hidden"]
FLAGS_ENV = "PAGEDCHAT_NATIVE_CFLAGS"  # the target flags, instead of -march=native
ENV_SWITCH = "PAGEDCHAT_NATIVE"
CACHE_ENV = "PAGEDCHAT_NATIVE_CACHE"  # where builds live (the tests keep one for the session: conftest.py)
# A build marker older than this is a build that died (killed machine, full disk): try again.
STALE_BUILD_S = 300

_loaded: "ctypes.CDLL | None" = None
_why_not = "not tried"
log = logging.getLogger("pagedchat.native")  # with no logging set up, warnings still reach stderr


def flags() -> list[str]:
    """The compiler flags: the fixed ones and the target's (-march=native, or $PAGEDCHAT_NATIVE_CFLAGS)."""
    return [*BASE_FLAGS, *(os.environ.get(FLAGS_ENV) or "-march=native").split()]


def cache_dir() -> Path:
    """$PAGEDCHAT_NATIVE_CACHE, else $XDG_CACHE_HOME/pagedchat/native (~/.cache/pagedchat/native)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return dirs.cache_dir("native")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def library_path(compiler: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join([compiler, *flags()]).encode(), _cpu_signature().encode()):
        digest.update(part)
    return cache_dir() / f"decode-{digest.hexdigest()[:16]}.so"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _failed_marker(target: Path) -> Path:
    return target.with_suffix(".failed")


def _building_marker(target: Path) -> Path:
    return target.with_suffix(".building")


def _record(target: Path) -> Path:
    """Where a build's size and digest are kept."""
    return target.with_suffix(".sum")


def _fingerprint(path: Path | str) -> str:
    data = Path(path).read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(target: Path) -> bool:
    """Whether the cached library is the one its build recorded (size first: a truncated file is the usual
    damage, and costs no read)."""
    try:
        size, _ = _record(target).read_text().split()
        return target.stat().st_size == int(size) and _fingerprint(target) == _record(target).read_text().strip()
    except (OSError, ValueError):
        return False


def _discard_damaged(target: Path) -> None:
    """A library that fails its check is removed (a process that has it mapped keeps its inode), with one line
    saying so."""
    log.warning("pagedchat: the cached native library %s does not match its build record (damaged or "
                "incomplete); rebuilding it", target)
    for path in (target, _record(target)):
        path.unlink(missing_ok=True)


def build(compiler: str, target: Path) -> None:
    """Compile to a private file, record its size and digest, and rename both into place (the record first: a
    library is never visible without it); a failure is written beside the target and raised."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    record_tmp = tmp + ".sum"
    try:
        subprocess.run([compiler, *flags(), "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        with open(record_tmp, "w") as f:
            f.write(_fingerprint(tmp))
            f.flush()
            os.fsync(f.fileno())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes on disk before the name: a crash never leaves a named stub
        os.replace(record_tmp, _record(target))
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        try:
            _failed_marker(target).write_text(_first_line(e))
        except OSError:
            pass  # (the folder itself cannot be written: every process finds that out again)
        raise
    finally:
        for leftover in (tmp, record_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _start_background_build(compiler: str, target: Path) -> bool:
    """Start this file as a detached build, unless one is already running; whether one runs."""
    target.parent.mkdir(parents=True, exist_ok=True)
    marker = _building_marker(target)
    try:
        if time.time() - marker.stat().st_mtime < STALE_BUILD_S:
            return True
        marker.unlink()
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True  # another process just started it
    # this file as a script: the standard library only, no pagedchat (or torch) import in the builder
    subprocess.Popen([sys.executable, __file__, compiler, str(target)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return True


def _first_line(e: BaseException) -> str:
    detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
    return detail[-1] if detail else type(e).__name__


def load(wait: bool = False) -> "ctypes.CDLL | None":
    """The compiled decode step, or None. With no build cached: wait=True builds it now; wait=False starts a
    background build and returns None (call again later). Never raises: whatever stops it (no compiler, a
    failed build, a cache folder that cannot be written) leaves the torch path and a reason in status()."""
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        _why_not = f"{ENV_SWITCH}=0"
        return None
    compiler = _compiler()
    if compiler is None:
        _why_not = "no C compiler (cc, gcc or clang) on PATH"
        return None
    target = library_path(compiler)
    failed = _failed_marker(target)
    try:
        if target.exists() and not _intact(target):
            _discard_damaged(target)
        if not target.exists() and failed.exists():
            _why_not = f"build failed: {failed.read_text().strip()} (remove {failed} to try again)"
            return None
        if not target.exists() and not wait:
            _start_background_build(compiler, target)
            _why_not = "building in the background"
            return None
        if not target.exists():
            build(compiler, target)
    except (OSError, subprocess.SubprocessError) as e:
        _why_not = f"build failed: {_first_line(e)}"
        return None
    try:
        _loaded = ctypes.CDLL(str(target))
    except OSError as e:
        _why_not = f"cannot load {target.name}: {e}"
        return None
    return _loaded


def build_info(lib: ctypes.CDLL) -> str:
    """What a library was built for: its vector ISA and tile shape ("avx2 vw=8 tile=4x3")."""
    lib.pc_build_info.restype = ctypes.c_char_p
    return lib.pc_build_info().decode()


def building() -> bool:
    """The last load() found no build and one is being made in the background: try again later."""
    return _loaded is None and _why_not == "building in the background"


def status() -> str:
    """One line: whether the native decode step is available, and why not."""
    lib = load()
    return f"native decode: on ({build_info(lib)})" if lib is not None else f"native decode: off ({_why_not})"


def _main(compiler: str, target: str) -> int:
    try:
        build(compiler, Path(target))
        return 0
    except (OSError, subprocess.SubprocessError):
        return 1
    finally:
        _building_marker(Path(target)).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:3]))
