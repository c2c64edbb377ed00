"""What every benchmark shares: seeded length draws, percentiles, process memory, rich tables, JSON output."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import subprocess
import sys


def lognormal_lengths(rng: random.Random, count: int, mean: float, sigma: float, low: int, high: int) -> list[int]:
    """`count` integer lengths from a lognormal with the given MEAN (not median), clipped to [low, high]."""
    if mean <= 0:
        return [low] * count
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2) = mean
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- process memory ------------------------------------------------------------------------------------------
# tracemalloc does not see torch's allocator, so on CPU we read the kernel's resident-set counters instead.
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0). Returns False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


class PeakMemory:
    """Peak memory above a baseline taken at start(): CUDA allocator peak on a GPU, resident set on a CPU."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.baseline = 0

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            if not reset_peak_rss():
                raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): peak memory unavailable")
            self.baseline = rss_bytes()

    def peak_delta(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return peak_rss_bytes() - self.baseline


# Vector extensions that decide CPU speed, best first: the first one the CPU has names its ISA.
_ISAS = (("avx512f", ("avx512f",)), ("avx2+fma", ("avx2", "fma")), ("avx", ("avx",)), ("sse4.2", ("sse4_2",)),
         ("sve", ("sve",)), ("neon", ("asimd",)))


def _cpu() -> tuple[str, str]:
    """(model name, vector ISA) from /proc/cpuinfo; the ISA from the flags (x86) or features (ARM) line."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    isa = next((label for label, needed in _ISAS if all(f in flags for f in needed)), "unknown")
    return name, isa


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The kernel driver's version (what nvidia-smi shows)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict:
    """The hardware and software every number depends on: CPU model and vector ISA, core count, and when a
    GPU is visible its name, memory, driver and CUDA; torch, triton and transformers versions."""
    cpu, isa = _cpu()
    info = {"cpu": cpu, "cpu_isa": isa, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": _version("torch"), "triton": _version("triton"), "transformers": _version("transformers")}
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_capability=f"{props.major}.{props.minor}", driver=_nvidia_driver(), cuda=torch.version.cuda)
    return info


def machine_description(info: dict | None = None) -> str:
    """One line naming the hardware the numbers come from (machine_info's fields)."""
    info = info or machine_info()
    versions = ", ".join(f"{name} {info[name]}" for name in ("torch", "triton", "transformers") if info.get(name))
    cpu = f"{info['cores']}-core CPU ({info['cpu']}, {info['cpu_isa']})"
    if "gpu" in info:
        return f"{info['gpu']} (driver {info['driver'] or '?'}, CUDA {info['cuda']}), {cpu}, {versions}"
    return f"{cpu}, no GPU, {versions}"


def quiet_transformers() -> None:
    """No progress bars or advisory logs from transformers in the middle of a benchmark's output."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


# -- output --------------------------------------------------------------------------------------------------
def print_json(data: dict) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


PARTIAL = "pagedchat-partial "   # the prefix of a finished row of a run still going (report_partial)
PARTIAL_ENV = "PAGEDCHAT_PARTIAL_ROWS"   # set by a caller that reads them (the GPU check); else nothing is printed


def report_partial(row: dict) -> None:
    """One finished row of a run still going, as a line on stderr, when the caller asked for them: what a caller
    that stops the run at a time limit keeps (the GPU check's steps read these when the run's JSON never came)."""
    if os.environ.get(PARTIAL_ENV):
        print(PARTIAL + json.dumps(row, default=str), file=sys.stderr, flush=True)


def partial_rows(stderr: str) -> list[dict]:
    """The rows report_partial wrote into this output, in order."""
    return [json.loads(line[len(PARTIAL):]) for line in stderr.splitlines() if line.startswith(PARTIAL)]


def print_table(title: str, columns: list[str], rows: list[list], caption: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[fmt(v) for v in row])
    # Piped output (docs, logs) gets room for every column; a terminal keeps its own width.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def save_figure(fig, path) -> None:
    """PNG small enough for a README (< 200 KB): modest size and dpi, palette-friendly flat colours."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")


def run_worker(module: str, worker: str, spec: dict, workdir, timeout: float, label: str,
               env: dict[str, str] | None = None) -> dict:
    """`python -m module worker SPEC OUT` in its own process (a clean interpreter per system and run, so no
    system inherits another's threads, caches or allocations): the spec goes in as JSON, the result comes back
    as JSON. A run that fails or times out is one UserError naming `label`."""
    import time
    from pathlib import Path

    from pagedchat.errors import UserError

    spec_path = Path(workdir) / f"{label.replace(' ', '-')}-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    out = spec_path.with_suffix(".out")
    cmd = [sys.executable, "-m", module, worker, str(spec_path), str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise UserError(f"{label} run did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{label} run failed: {tail[0]}")
    return json.loads(out.read_text())
