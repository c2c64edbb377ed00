"""The native decode step (decode.c) bound to one loaded Llama-family model and its pool's caches.

`NativeDecode.bind(model, k_caches, v_caches, block_size)` returns None for what the C step does not cover, and the
runner keeps the torch path for those: another family (Gemma, MoE, Phi-3's partial rotary), sliding-window
layer groups, a dtype other than fp32 (its weights; int8 layers keep fp32 activations), a device other than
CPU, or no compiler. The structs below mirror decode.c's; their sizes are checked against the library's.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import dataclass, field
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

import torch
from torch import nn

from pagedchat.native import build

_ptr = c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("scales", _ptr), ("bias", _ptr), ("out", c_int64), ("in_", c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", _ptr), ("v_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", c_int64), ("num_layers", c_int64), ("num_heads", c_int64),
                ("num_kv_heads", c_int64), ("head_dim", c_int64), ("vocab", c_int64), ("block_size", c_int64),
                ("eps", c_float), ("scale", c_float), ("embed", _ptr), ("norm", _ptr), ("lm_head", _Linear),
                ("cos", _ptr), ("signed_sin", _ptr), ("layers", POINTER(_Layer))]


MAX_HEAD_DIM = 1024  # decode.c's rotary scratch


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(module: nn.Module) -> _Linear | None:
    """A plain, oneDNN-packed (its plain weight) or int8 layer; None for anything else."""
    from pagedchat.model.packed import PackedLinear
    from pagedchat.model.quantize import Int8Linear

    bias = getattr(module, "bias", None)
    if isinstance(module, Int8Linear):
        w, scales = module.weight, module.scales
        if w.dtype != torch.int8 or not w.is_contiguous() or not _fp32(scales):
            return None
    elif isinstance(module, (nn.Linear, PackedLinear)):
        w, scales = module.weight, None
        if not _fp32(w):
            return None
    else:
        return None
    if not _fp32(bias):
        return None
    return _Linear(_addr(w), _addr(scales), _addr(bias), w.shape[0], w.shape[1])


HUGE_PAGE = 2 << 20


def _weights_in_step_order(model: nn.Module) -> list[nn.Module]:
    """The linear layers a decode step streams, in the order it reads them."""
    order = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        order += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return order + [model.lm_head]


def gather_weights(modules: list[nn.Module]) -> mmap.mmap | None:
    """Move the weights of `modules` into one private anonymous arena, in that order: a decode step then streams
    one region front to back, and the hardware prefetcher never restarts at another allocation. The arena asks
    for transparent huge pages (no TLB misses in the stream) where the kernel grants them; this project's
    sandbox grants none, so the measured gain is the single region's: the small llama's native step, 5
    alternating process pairs, median 8.2 ms against 9.0 ms with torch's separate allocations. (A shared
    mapping, mmap's default, measured slower than either: it must be MAP_PRIVATE.) The modules' tensors are
    rebound to views of the arena (values unchanged); returns the arena, which must outlive them, or None when
    there is nothing to gather."""
    tensors = [m.weight for m in modules]
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    if total == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (no private anonymous mappings: leave them be)
        return None
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(arena, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE_PAGE  # a 2 MiB boundary: where a huge page can start
    if hasattr(arena, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE, start, total)  # before the first touch: faults take huge pages
    for module, t, offset in zip(modules, tensors, offsets):
        nbytes = t.numel() * t.element_size()
        view = base[start + offset:start + offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        if isinstance(t, nn.Parameter):
            t.data = view  # every holder of the parameter (a tied embedding, PackedLinear) sees the arena
        else:
            module.weight = view  # a registered buffer (Int8Linear)
    return arena


class ThreadChoice:
    """How many threads a decode step of each batch size runs on: the thread budget, half of it, or one,
    whichever measures fastest.

    Why: beside a busy process one of our threads shares its core, and every phase of a step waits for it at a
    barrier. On the 2-core machine (small llama, batch 1, beside a CPU burner) 2 threads then ran a step in
    9.7 ms and 1 thread in 8.7 ms; on the quiet machine 2 threads take 3.9 ms and 1 takes 8.7 ms.

    How, without costing a quiet machine anything: a step's CPU time over its wall time and threads says
    whether its threads had their cores (0.98-0.99 quiet, 0.43-0.52 beside a burner, measured). A few steps of
    low use, or of sudden slowness, start a trial: TRIAL_STEPS steps on another option, and the cheapest
    option is kept. Below the full budget, trials come every so often (16 steps, doubling to MAX_INTERVAL) to
    notice when the cores are free again; at the full budget only every MAX_INTERVAL steps."""

    TRIAL_STEPS = 5           # the first of them warms the other thread count up and is not counted
    AFTER_SWITCH = 16
    MAX_INTERVAL = 1024
    BUSY_USE = 0.75           # CPU time / (wall time x threads) below this: the threads did not have their cores
    SLOWER = 1.4              # or a step this much slower than the option's average
    STRIKES = 3               # this many such steps in a row start a trial
    EMA = 0.3

    def __init__(self, budget: int):
        self.options = sorted({budget, max(1, budget // 2), 1}, reverse=True)
        self.batches: dict[int, _Choice] = {}

    def _state(self, batch: int) -> "_Choice":
        if batch not in self.batches:
            self.batches[batch] = _Choice(best=self.options[0], interval=self.AFTER_SWITCH,
                                          next_trial=self.MAX_INTERVAL)
        return self.batches[batch]

    def pick(self, batch: int) -> int:
        if len(self.options) == 1:
            return self.options[0]
        st = self._state(batch)
        if st.left == 0:
            st.steps += 1
            if st.steps >= st.next_trial or st.strikes >= self.STRIKES:
                others = [t for t in self.options if t != st.best]
                st.trial, st.left, st.strikes = others[st.trials % len(others)], self.TRIAL_STEPS, 0
                st.trials += 1
        return st.trial if st.left else st.best

    def record(self, batch: int, threads: int, seconds: float, cpu_seconds: float) -> None:
        """One step's wall time and the process's CPU time during it (other threads of ours that run meanwhile
        count too: they can hide a starved step, never invent one)."""
        if len(self.options) == 1:
            return
        st = self._state(batch)
        if st.left == 0:  # a step of the chosen option
            starved = threads > 1 and cpu_seconds < self.BUSY_USE * seconds * threads
            slow = threads in st.cost and seconds > self.SLOWER * st.cost[threads]
            st.strikes = st.strikes + 1 if starved or slow else 0
        else:
            st.left -= 1
            if st.left == self.TRIAL_STEPS - 1:
                return  # the warm-up step
        old = st.cost.get(threads)
        st.cost[threads] = seconds if old is None else (1 - self.EMA) * old + self.EMA * seconds
        if st.trial is not None and st.left == 0:
            best = min(st.cost, key=st.cost.get)
            if best == self.options[0]:
                st.interval = self.MAX_INTERVAL
            elif best != st.best:
                st.interval = self.AFTER_SWITCH
            else:
                st.interval = min(2 * st.interval, self.MAX_INTERVAL)
            st.best, st.trial = best, None
            st.next_trial = st.steps + st.interval


@dataclass
class _Choice:
    """ThreadChoice's state for one batch size."""
    best: int                     # the thread count in use
    interval: int                 # steps between trials
    next_trial: int               # the step count at which the next trial starts
    cost: dict[int, float] = field(default_factory=dict)  # threads -> average seconds per step
    steps: int = 0                # steps taken on the chosen option
    trial: int | None = None      # the thread count on trial
    left: int = 0                 # steps of the trial still to run
    trials: int = 0               # trials so far (they take the other options in turn)
    strikes: int = 0              # starved or slow steps in a row


class NativeDecode:
    """Runs a decode step through decode.c; holds the tensors it points into so they stay alive."""

    def __init__(self, lib: ctypes.CDLL, model_struct: _Model, layers, keep: list):
        self.lib, self.struct, self.layers, self.keep = lib, model_struct, layers, keep
        self.vocab = model_struct.vocab
        self.threads: ThreadChoice | None = None
        lib.pc_decode_step.restype = c_int
        lib.pc_decode_step.argtypes = [POINTER(_Model), c_int64, _ptr, _ptr, _ptr, c_int64, _ptr, _ptr, c_int]

    @staticmethod
    def supports(model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> bool:
        """Whether decode.c covers this model and pool (the library aside)."""
        from pagedchat.model.layers import RotaryEmbedding
        from pagedchat.model.llama import LlamaFamilyModel

        if type(model) is not LlamaFamilyModel or type(model.rotary) is not RotaryEmbedding:
            return False
        spec = model.spec
        if spec.head_dim > MAX_HEAD_DIM or len(k_caches) != spec.num_layers:
            return False
        if not all(_fp32(t) for t in (model.embed_tokens.weight, model.norm.weight, model.rotary.cos,
                                       model.rotary.signed_sin, *k_caches, *v_caches)):
            return False
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if spec.qk_norm:
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            if not all(_fp32(t) for t in norms) or attn.attn.k_cache is not k_caches[i] \
                    or attn.attn.v_cache is not v_caches[i]:
                return False
        return all(_linear(m) is not None for m in _weights_in_step_order(model))

    @classmethod
    def bind(cls, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
             block_size: int, k_scales: list[torch.Tensor] | None = None,
             v_scales: list[torch.Tensor] | None = None) -> "NativeDecode | None":
        """The native step for this model, or None: not supported, or no library (yet: build.building()).
        k_scales / v_scales: a quantized pool's scales (pagedchat/kernels/kv_quant.py); decode.c reads fp32
        caches only so far, so a quantized pool gets None (the runner does not even ask yet)."""
        if k_scales is not None or v_scales is not None or not cls.supports(model, k_caches, v_caches):
            return None
        lib = build.load()
        if lib is None or lib.pc_sizeof_model() != ctypes.sizeof(_Model) \
                or lib.pc_sizeof_layer() != ctypes.sizeof(_Layer):
            return None
        spec = model.spec
        arena = gather_weights(_weights_in_step_order(model))
        layers = (_Layer * spec.num_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            qk = [attn.q_norm.weight, attn.k_norm.weight] if spec.qk_norm else [None, None]
            layers[i] = _Layer(*(_addr(t) for t in norms + qk), *linears, _addr(k_caches[i]), _addr(v_caches[i]))
        lm_head = _linear(model.lm_head)
        struct = _Model(spec.hidden_size, spec.num_layers, spec.num_heads,
                        spec.num_kv_heads, spec.head_dim, spec.vocab_size, block_size, spec.rms_norm_eps,
                        model.layers[0].self_attn.attn.scale, _addr(model.embed_tokens.weight),
                        _addr(model.norm.weight), lm_head, _addr(model.rotary.cos), _addr(model.rotary.signed_sin),
                        layers)
        return cls(lib, struct, layers, [model, k_caches, v_caches, arena])

    def step(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of a decode step (one new token per sequence, its K/V written into the pool)."""
        assert ids.dtype == positions.dtype == torch.int64 and block_tables.dtype == seq_lens.dtype == torch.int32
        assert block_tables.is_contiguous() and ids.is_contiguous() and positions.is_contiguous()
        batch, budget = ids.shape[0], torch.get_num_threads()
        if self.threads is None or self.threads.options[0] != budget:  # (the budget was changed: start over)
            self.threads = ThreadChoice(budget)
        threads = self.threads.pick(batch)
        logits = torch.empty((batch, self.vocab), dtype=torch.float32)
        wall, cpu = time.perf_counter(), time.process_time()
        rc = self.lib.pc_decode_step(ctypes.byref(self.struct), batch, ids.data_ptr(), positions.data_ptr(),
                                     block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
                                     logits.data_ptr(), threads)
        self.threads.record(batch, threads, time.perf_counter() - wall, time.process_time() - cpu)
        if rc != 0:
            raise MemoryError("native decode step: no memory for its scratch buffers")
        return logits
