"""A guard that fails on anything a CUDA graph cannot capture, usable on CPU tensors.

Inside `no_host_sync()` every aten op is inspected as it runs (a TorchDispatchMode). It flags what would, on
a GPU, copy data between host and device or wait for the device in the middle of a decode step:
  - reading a value back to Python: `.item()`, `int(t)`, `bool(t)`, `float(t)` (aten._local_scalar_dense),
    and `.tolist()` / `.numpy()` / `.cpu()` (patched: they do not dispatch an op on a CPU tensor);
  - a tensor made from host data: `torch.tensor(...)`, `torch.as_tensor(list)`, `torch.from_numpy`
    (aten.lift_fresh), and any copy between two devices;
  - ops whose output size depends on the data, so CUDA reads it back: nonzero, masked_select, unique,
    bincount, repeat_interleave without output_size, indexing with a boolean mask, ...
The Triton interpreter's own host copies (it runs a kernel on a host view of its arguments) are not flagged:
they stand in for a kernel launch, which a graph captures.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    "aten::_local_scalar_dense": "reads a value back to the host (.item(), int(), bool())",
    "aten::lift_fresh": "makes a tensor from host data (torch.tensor / as_tensor of Python values)",
    "aten::lift_fresh_copy": "makes a tensor from host data",
    "aten::bincount": "sizes its output from the data (CUDA reads the ids' min and max back)",
    "aten::nonzero": "sizes its output from the data",
    "aten::masked_select": "sizes its output from the data",
    "aten::unique_consecutive": "sizes its output from the data",
    "aten::unique_dim": "sizes its output from the data",
    "aten::_unique": "sizes its output from the data",
    "aten::_unique2": "sizes its output from the data",
    "aten::equal": "returns a Python bool",
    "aten::is_nonzero": "returns a Python bool",
    "aten::allclose": "returns a Python bool",
    "aten::histc": "reads the data's range back when min == max",
}
_HOST_METHODS = ("tolist", "numpy", "cpu")


class HostSyncError(AssertionError):
    pass


class _Guard(TorchDispatchMode):
    def __init__(self, violations: list[str]):
        super().__init__()
        self.violations = violations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _in_triton_launch():
            why = _why(func, args, kwargs)
            if why:
                self.violations.append(f"{func}: {why}")
        return func(*args, **kwargs)


def _why(func, args, kwargs) -> str | None:
    name = func._schema.name
    if name in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[name]
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
        return "sizes its output from the repeats unless output_size is given"
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "indexes with a boolean mask (a nonzero inside)"
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    devices = {t.device for t in tensors}
    target = kwargs.get("device")
    if len(devices) > 1 and name in ("aten::copy_", "aten::_to_copy", "aten::_copy_from"):
        return f"copies between {' and '.join(sorted(map(str, devices)))}"
    if name == "aten::_to_copy" and target is not None and devices and torch.device(target) not in devices:
        return f"copies to {target}"
    return None


_launch = threading.local()


def _in_triton_launch() -> bool:
    return getattr(_launch, "depth", 0) > 0


@contextlib.contextmanager
def _triton_launches_allowed():
    """The interpreter's GridExecutor copies its arguments to the host and back: a launch, not a sync."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        _launch.depth = getattr(_launch, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _launch.depth -= 1

    interpreter.GridExecutor.__call__ = launch
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = original


@contextlib.contextmanager
def _host_methods_flagged(violations: list[str]):
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}

    def flagged(name):
        def method(self, *args, **kwargs):
            if not _in_triton_launch():
                violations.append(f"Tensor.{name}(): copies the tensor to the host")
            return originals[name](self, *args, **kwargs)
        return method

    for name in _HOST_METHODS:
        setattr(torch.Tensor, name, flagged(name))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def recording_host_syncs():
    """Collect, into the list it yields, every op inside that a CUDA graph could not capture."""
    violations: list[str] = []
    with _triton_launches_allowed(), _host_methods_flagged(violations), _Guard(violations):
        yield violations


@contextlib.contextmanager
def no_host_sync(what: str = "the guarded code"):
    """Raise HostSyncError at exit when anything inside would sync with the host."""
    with recording_host_syncs() as violations:
        yield
    if violations:
        unique = list(dict.fromkeys(violations))
        raise HostSyncError(f"{what} syncs with the host ({len(violations)} times):\n  " + "\n  ".join(unique))
