"""decode.c's interface as ctypes sees it, without torch: the weight formats, the structs a model is described
by (their sizes checked against the library's), the step's signature, and how many threads a step runs on.

Two binders fill these structs: native/step.py from a loaded torch model (the engine's runner), and
pagedchat/quick from a GGUF file's mapped bytes (a one-shot reply that never imports torch).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p
from dataclasses import dataclass, field

_ptr = c_void_p

FMT_F32, FMT_I8, FMT_I4 = 0, 1, 2  # decode.c's weight formats
FMT_GGML = 100  # a GGUF format: this + its ggml type number
# The GGUF types decode.c reads in the file's layout (pagedchat/model/gguf/quants.py describes them), by ggml
# type number. Block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) meet the input
# quantized to 8 bits a block of 32; float ones (F16, BF16) meet it in fp32 (decode.c tile_f16 says why). A
# layer's parts share one input, so they are all of one kind.
GGML_BLOCKS = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})
GGML_FLOATS = frozenset({1, 30})
GGML_NATIVE = GGML_BLOCKS | GGML_FLOATS


class Linear(ctypes.Structure):
    pass


# next: the rows past `rows`, in another part's format (decode.c's Linear says how a layer of several formats is
# held); NULL for a layer of one
Linear._fields_ = [("weight", _ptr), ("scales", _ptr), ("bias", _ptr), ("out", c_int64), ("in_", c_int64),
                    ("format", c_int64), ("rows", c_int64), ("next", POINTER(Linear))]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("k_cache", _ptr), ("v_cache", _ptr), ("k_scales", _ptr), ("v_scales", _ptr),
                ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("window", c_int64), ("group", c_int64)]


class Model(ctypes.Structure):
    _fields_ = [("hidden", c_int64), ("num_layers", c_int64), ("num_heads", c_int64),
                ("num_kv_heads", c_int64), ("head_dim", c_int64), ("vocab", c_int64), ("block_size", c_int64),
                ("eps", c_float), ("scale", c_float), ("embed", _ptr), ("norm", _ptr), ("lm_head", Linear),
                ("cos", _ptr), ("sin", _ptr), ("layers", POINTER(Layer)), ("embed_scale", c_float),
                ("gelu", c_int64), ("embed_format", c_int64), ("embed_row_bytes", c_int64)]


MAX_HEAD_DIM = 1024  # decode.c's rotary scratch


def chain(parts: list[tuple[int, int, int]], in_features: int, out_features: int, bias: int | None = None) -> Linear:
    """One linear layer whose rows come in parts, each (address, ggml type, rows) in the file's own layout: a
    Linear per part, each pointing at the next (fused q/k/v or gate/up whose parts have different types)."""
    head = None
    for addr, qtype, rows in reversed(parts):  # (built from the last part: each points at the one after it)
        head = Linear(addr, None, None, 0, in_features, FMT_GGML + qtype, rows,
                      None if head is None else ctypes.pointer(head))
    head.out, head.bias = out_features, bias
    return head


def matches(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` is a library whose structs are the ones above (a stale build is never handed pointers)."""
    return lib is not None and lib.pc_sizeof_model() == ctypes.sizeof(Model) \
        and lib.pc_sizeof_layer() == ctypes.sizeof(Layer)


def declare_step(lib: ctypes.CDLL) -> None:
    """pc_step(model, T, ids, positions, B, cu_seqlens_q, block_tables, table_width, logits, threads,
    sampled_rows or -1, sampled row indices or NULL) -> 0, or non-zero when its scratch could not be allocated."""
    lib.pc_step.restype = c_int
    lib.pc_step.argtypes = [POINTER(Model), c_int64, _ptr, _ptr, c_int64, _ptr, _ptr, c_int64, _ptr, c_int,
                            c_int64, _ptr]


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
