"""The native step (decode.c) bound to one loaded Llama-family or Gemma 3 model and its pool's caches.

`NativeDecode.bind(model, k_caches, v_caches, block_size, k_scales=None, v_scales=None)` returns None for what
the C step does not cover, and the runner keeps the torch path for those: another family (Gemma 2's
soft-capping, MoE, Phi-3's partial rotary), a dtype other than fp32 (its weights, beside int8 and int4
layers and a GGUF file's formats; its pool, beside int8 K/V with float16 scales), a GGUF layer with a part in a
type decode.c does not read (GGML_NATIVE lists those it does) or with float parts (F16, BF16) beside block-format
ones, a device other than CPU, or no compiler. The structs it fills are decode.c's (native/abi.py).

A GGUF layer (pagedchat/model/gguf/linear.py) is read in the file's layout, nothing repacked: one Linear per
part, chained, so fused q/k/v and gate/up whose parts have different types run each part in its own format.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import dataclass, field
from pathlib import Path
from ctypes import POINTER, c_int64, c_void_p

import torch
from torch import nn

from pagedchat.memory import libc
from pagedchat.native import abi, build
from pagedchat.native.abi import (FMT_F32, FMT_GGML, FMT_I4, FMT_I8, GGML_BLOCKS, GGML_FLOATS,  # noqa: F401
                                  GGML_NATIVE, MAX_HEAD_DIM, Layer, Linear, Model, ThreadChoice)
from pagedchat.native.paths import PathChoice

_ptr = c_void_p


def _plain(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")


def _fp32(t: torch.Tensor | None) -> bool:
    return _plain(t, torch.float32)


def _pool_fits(k_caches, v_caches, k_scales, v_scales) -> bool:
    """fp32 caches, or int8 caches with one float16 scale per (slot, kv head) (kernels/kv_quant.py)."""
    if k_scales is None and v_scales is None:
        return all(_fp32(t) for t in (*k_caches, *v_caches))
    if k_scales is None or v_scales is None or not len(k_scales) == len(v_scales) == len(k_caches):
        return False
    return all(_plain(t, torch.int8) for t in (*k_caches, *v_caches)) \
        and all(_plain(s, torch.float16) and s.shape == c.shape[:-1]
                for s, c in zip((*k_scales, *v_scales), (*k_caches, *v_caches)))


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _int4_tensors(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed, scales) of an int4 layer (pagedchat/model/int4.py's layout: uint8 [out, in / 2], float16
    [out, in / 32]), found by those tensors on the module whatever its class."""
    from pagedchat.model.int4 import GROUP

    packed, scales = getattr(module, "packed", None), getattr(module, "scales", None)
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor) or packed.dim() != 2:
        return None
    if not (_plain(packed, torch.uint8) and _plain(scales, torch.float16)) \
            or scales.shape != (packed.shape[0], packed.shape[1] * 2 // GROUP):
        return None
    return packed, scales


def _gguf_linear(module: nn.Module) -> Linear | None:
    """A GGUFLinear read in the file's layout: one Linear per part, chained through `next` (q, k and v, or gate
    and up, may each be another type); None when a part's type is one decode.c does not read, float parts sit
    beside block-format ones (the two kinds take their input in different forms), or a part is not plain CPU
    bytes."""
    parts = module.parts
    kinds = {qtype in GGML_FLOATS for _, qtype in parts}
    if not all(qtype in GGML_NATIVE and _plain(raw, torch.uint8) for raw, qtype in parts) or len(kinds) > 1 \
            or module.in_features % 32 or not _fp32(module.bias):
        return None
    return abi.chain([(_addr(raw), qtype, raw.shape[0]) for raw, qtype in parts], module.in_features,
                     module.out_features, _addr(module.bias))


def _linear(module: nn.Module) -> Linear | None:
    """A plain, oneDNN-packed (its plain weight), int8, int4 or GGUF layer; None for anything else."""
    from pagedchat.model.gguf.linear import GGUFLinear
    from pagedchat.model.packed import PackedLinear
    from pagedchat.model.quantize import Int8Linear

    if isinstance(module, GGUFLinear):
        return _gguf_linear(module)
    bias = getattr(module, "bias", None)
    int4 = _int4_tensors(module)
    if int4 is not None:
        (w, scales), fmt = int4, FMT_I4
        out, in_ = w.shape[0], w.shape[1] * 2
    elif isinstance(module, Int8Linear):
        w, scales, fmt = module.weight, module.scales, FMT_I8
        if w.dtype != torch.int8 or not w.is_contiguous() or not _fp32(scales):
            return None
        out, in_ = w.shape
    elif isinstance(module, (nn.Linear, PackedLinear)):
        w, scales, fmt = module.weight, None, FMT_F32
        if not _fp32(w):
            return None
        out, in_ = w.shape
    else:
        return None
    if not _fp32(bias):
        return None
    return Linear(_addr(w), _addr(scales), _addr(bias), out, in_, fmt, out, None)


def runs_gguf_as_stored(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the native step's forward covers this model and binds every GGUF layer's formats (checked
    before the pool exists: the model's family, dtype and layer formats; the library aside)."""
    from pagedchat.model.gguf.linear import GGUFLinear

    if dtype != torch.float32 or _plan(model, check_caches=False) is None:
        return False
    return all(_linear(m) is not None for m in model.modules() if isinstance(m, GGUFLinear))


@dataclass
class _LayerPlan:
    """What decode.c reads of one decoder layer (decode.c's Layer says what each is)."""
    linears: tuple                      # qkv, o, gate_up, down modules
    input_norm: torch.Tensor
    post_norm: torch.Tensor             # before the MLP
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor               # as bound to the pool (bind takes the scales of an int8 pool)
    v_cache: torch.Tensor
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    cos: torch.Tensor | None = None     # None: the model's tables
    sin: torch.Tensor | None = None
    window: int = 0
    group: int = 0


@dataclass
class _Plan:
    """What decode.c reads of a model: the Llama family's forward, or Gemma 3's (its norms scale by 1 + weight:
    the sums are made here, once, exactly as GemmaRMSNorm makes them)."""
    layers: list[_LayerPlan]
    norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float
    embed_scale: float = 1.0
    gelu: bool = False
    rotaries: list = field(default_factory=list)   # whose PositionTables the cos / sin pointers are views of


def _plan(model: nn.Module, check_caches: bool = True, layer_groups: tuple[int, ...] | None = None) -> _Plan | None:
    """The plan of a model decode.c runs, or None: another family (Gemma 2's soft-capping, MoE, partial
    rotary, longrope), a tensor not plain fp32 on the CPU, a head too large. check_caches=False: before the
    pool exists. layer_groups: each layer's block-table group when the pool keeps window layers in groups of
    their own (KVGroups.layer_group); None: every layer reads the one table (windows then only mask)."""
    from pagedchat.model.gemma import GemmaModel
    from pagedchat.model.layers import RotaryEmbedding
    from pagedchat.model.llama import LlamaFamilyModel

    spec = getattr(model, "spec", None)
    if spec is None or spec.head_dim > MAX_HEAD_DIM or _embedding(model.embed_tokens) is None:
        return None
    if type(model) is LlamaFamilyModel and type(model.rotary) is RotaryEmbedding:
        plan = _Plan([], model.norm.weight, model.rotary.cos, model.rotary.sin, model.layers[0].self_attn.attn.scale,
                     rotaries=[model.rotary])
        for layer in model.layers:
            attn = layer.self_attn
            plan.layers.append(_LayerPlan(
                (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj),
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.q_norm.weight if spec.qk_norm else None, attn.k_norm.weight if spec.qk_norm else None,
                *_caches(attn.attn)))
    elif type(model) is GemmaModel and _gemma3_covered(model):
        plus_one = lambda norm: (1.0 + norm.weight.float()).contiguous()   # noqa: E731
        first = model.layers[0].self_attn.rotary
        plan = _Plan([], plus_one(model.norm), first.cos, first.sin, model.layers[0].self_attn.attn.scale,
                     float(model.embed_scale), gelu=True,
                     rotaries=list({id(r): r for r in (layer.self_attn.rotary for layer in model.layers)}.values()))
        for layer, group in zip(model.layers, layer_groups or [0] * len(model.layers)):
            attn = layer.self_attn
            plan.layers.append(_LayerPlan(
                (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj),
                plus_one(layer.input_layernorm), plus_one(layer.pre_feedforward_layernorm),
                plus_one(attn.q_norm), plus_one(attn.k_norm), *_caches(attn.attn),
                attn_out_norm=plus_one(layer.post_attention_layernorm),
                mlp_out_norm=plus_one(layer.post_feedforward_layernorm), cos=attn.rotary.cos, sin=attn.rotary.sin,
                window=attn.attn.sliding_window or 0, group=group))
    else:
        return None
    norms = [t for p in plan.layers for t in (p.input_norm, p.post_norm, p.q_norm, p.k_norm, p.attn_out_norm,
                                               p.mlp_out_norm)]
    tables = [t for p in plan.layers for t in (p.cos, p.sin)]
    if not all(_fp32(t) for t in (plan.norm, plan.cos, plan.sin, *norms, *tables)):
        return None
    if check_caches and not all(_fp32(p.k_cache) or _plain(p.k_cache, torch.int8) for p in plan.layers):
        return None
    return plan


def _covered_plan(model, k_caches, v_caches, k_scales, v_scales, layer_groups) -> _Plan | None:
    """The model's plan when decode.c covers it and this pool: every layer bound to one of the pool's caches,
    every linear layer in a format it reads; else None."""
    plan = _plan(model, layer_groups=layer_groups)
    if plan is None or not _pool_fits(k_caches, v_caches, k_scales, v_scales):
        return None
    pool = {id(t) for t in (*k_caches, *v_caches)}
    if not all(id(layer.k_cache) in pool and id(layer.v_cache) in pool for layer in plan.layers):
        return None
    return plan if all(_linear(m) is not None for m in _weights_in_step_order(model)) else None


def _gemma3_covered(model) -> bool:
    """Gemma 3 as decode.c runs it: no soft-capping (Gemma 2's), q/k norms, every rotary over the whole head."""
    g = model.gemma
    return g.attn_softcap is None and g.final_softcap is None and g.qk_norm \
        and all(layer.self_attn.rotary.rotary_dim == model.spec.head_dim for layer in model.layers)


def _embedding(module: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(table, decode.c format) of the token embedding: an fp32 table, or a GGUF table's blocks in a block format
    (pagedchat/model/gguf/embedding.py; the loader dequantizes a float table); None for anything else."""
    from pagedchat.model.gguf.embedding import GGUFEmbedding

    if isinstance(module, GGUFEmbedding):
        ok = module.qtype in GGML_BLOCKS and _plain(module.blocks, torch.uint8) and module.embedding_dim % 32 == 0
        return (module.blocks, FMT_GGML + module.qtype) if ok else None
    weight = getattr(module, "weight", None)
    return (weight, FMT_F32) if isinstance(weight, torch.Tensor) and _fp32(weight) else None


def _caches(attention) -> tuple:
    """A paged attention layer's (k cache, v cache) as bound to the pool."""
    return attention.k_cache, attention.v_cache


def _stacked(tables: list[torch.Tensor]) -> torch.Tensor:
    """Block tables of every group as one int32 [groups * B, width] (narrower ones padded with -1)."""
    width = max(t.shape[1] for t in tables)
    out = torch.full((len(tables) * tables[0].shape[0], width), -1, dtype=torch.int32)
    for g, t in enumerate(tables):
        out[g * t.shape[0]:(g + 1) * t.shape[0], :t.shape[1]] = t
    return out


def run_linear(module: nn.Module, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """module(x) through decode.c's tiles on this thread (x [B, in] fp32): how the tests hold each weight
    format's arithmetic to torch's on the same input."""
    lib = lib or build.load(wait=True)
    layer = _linear(module)
    assert lib is not None and layer is not None, "no native library, or a layer it does not take"
    x = x.float().contiguous()
    y = torch.empty((x.shape[0], layer.out), dtype=torch.float32)
    lib.pc_linear.argtypes = [POINTER(Linear), _ptr, c_int64, _ptr]
    if lib.pc_linear(ctypes.byref(layer), x.data_ptr(), x.shape[0], y.data_ptr()) != 0:
        raise MemoryError("native linear: no memory for its scratch buffers")
    return y


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
    tensors = [(m, name, getattr(m, name)) for m in modules for name in _weight_names(m)]
    offsets, total = [], 0
    for _, _, t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    if total == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (no private anonymous mappings: leave them be)
        return None
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(arena, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE_PAGE  # a 2 MiB boundary: where a huge page can start
    if hasattr(arena, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE, start, total)  # before the first touch: faults take huge pages
    mapped = _file_mappings()
    for (module, name, t), offset in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        dest = base[start + offset:start + offset + nbytes]
        source = t.detach().contiguous().view(-1).view(torch.uint8)
        for at in range(0, nbytes, COPY_SLICE):   # a slice at a time: a large table is never resident twice
            dest[at:at + COPY_SLICE].copy_(source[at:at + COPY_SLICE])
            _drop_file_pages(source.data_ptr() + at, min(COPY_SLICE, nbytes - at), mapped)
        view = dest.view(t.dtype).view(t.shape)
        if isinstance(t, nn.Parameter):
            t.data = view  # every holder of the parameter (a tied embedding, PackedLinear) sees the arena
        else:
            setattr(module, name, view)  # a registered buffer (Int8Linear's weight, int4's packed, GGUF parts)
    return arena


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files (a GGUF file's weights are views of one). Not
    /dev/zero, memfd or deleted files: dropping a private mapping's pages there would lose them."""
    import os

    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if fields[4:5] != ["0"] and path.startswith("/") and not path.startswith("/dev/") \
                        and os.path.isfile(path):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    spans.append((start, end))
    except OSError:
        pass
    return spans


def _drop_file_pages(addr: int, nbytes: int, mapped: list[tuple[int, int]]) -> None:
    """Tell the kernel this process no longer needs the file pages a weight was just copied from. Why: the
    arena now holds the bytes, and without this both copies stay resident (Gemma 3 270M Q4_K_M: ~250 MB of
    the file's pages beside the arena). Only whole pages inside the weight's range of a file mapping are
    dropped, never anonymous memory; a page read again later comes back from the file."""
    page = mmap.PAGESIZE
    first, last = -(-addr // page) * page, (addr + nbytes) // page * page
    if last <= first or not any(s <= first and last <= e for s, e in mapped):
        return
    c = libc()
    if c is not None:
        c.madvise(c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


MADV_DONTNEED = 4  # Linux
COPY_SLICE = 4 << 20   # bytes gather_weights copies (and drops the file pages of) at a time


def _weight_names(module: nn.Module) -> list[str]:
    """The attributes holding a layer's weight bytes: a GGUF layer's parts (its buffers part0, part1, ...: the
    file's bytes move into the arena, and the layer's torch path reads them there), int4's packed, else weight."""
    from pagedchat.model.gguf.linear import GGUFLinear

    if isinstance(module, GGUFLinear):
        return module.part_names
    return ["packed" if _int4_tensors(module) is not None else "weight"]


class NativeDecode:
    """Runs a decode step through decode.c; holds the tensors it points into so they stay alive."""

    def __init__(self, lib: ctypes.CDLL, model_struct: Model, layers, keep: list, paths: PathChoice, groups: int = 1,
                 rotaries: list = ()):
        self.lib, self.struct, self.layers, self.keep = lib, model_struct, layers, keep
        self.rotaries = list(rotaries)  # whose cos / sin tables the struct points into
        self.groups = groups  # block tables per step: the global one, then one per window layer group
        self.vocab = model_struct.vocab
        self.threads: ThreadChoice | None = None
        self.paths = paths  # native or torch, per size of step (pagedchat/native/paths.py)
        abi.declare_step(lib)

    @staticmethod
    def supports(model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 k_scales: list[torch.Tensor] | None = None, v_scales: list[torch.Tensor] | None = None,
                 layer_groups: tuple[int, ...] | None = None) -> bool:
        """Whether decode.c covers this model and pool (the library aside)."""
        return _covered_plan(model, k_caches, v_caches, k_scales, v_scales, layer_groups) is not None

    @classmethod
    def bind(cls, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_size: int,
             k_scales: list[torch.Tensor] | None = None, v_scales: list[torch.Tensor] | None = None,
             layer_groups: tuple[int, ...] | None = None) -> "NativeDecode | None":
        """The native step for this model, or None: not supported, or no library (yet: build.building()).
        k_scales / v_scales: an int8 pool's float16 scales per layer, [num_blocks, block_size, kv_heads].
        layer_groups: as for _plan (the runner's KVGroups when its pool has window groups)."""
        plan = _covered_plan(model, k_caches, v_caches, k_scales, v_scales, layer_groups)
        if plan is None:
            return None
        lib = build.load()
        if not abi.matches(lib):
            return None
        spec = model.spec
        table = getattr(model.embed_tokens, "blocks", None)
        tied = table is not None and table is getattr(model.lm_head, "part0", None)
        arena = gather_weights(_weights_in_step_order(model))
        if tied:   # a GGUF table tied to the head: both read the head's copy in the arena (the file's pages go)
            model.embed_tokens.blocks = model.lm_head.part0
        layers = (Layer * spec.num_layers)()
        slot = {id(t): i for i, t in enumerate(k_caches)}   # a layer's scales: those of its cache in the pool
        for i, p in enumerate(plan.layers):
            linears = [_linear(m) for m in p.linears]
            scales = (k_scales[slot[id(p.k_cache)]], v_scales[slot[id(p.k_cache)]]) if k_scales else (None, None)
            layers[i] = Layer(*(_addr(t) for t in (p.input_norm, p.post_norm, p.q_norm, p.k_norm)), *linears,
                               *(_addr(t) for t in (p.k_cache, p.v_cache, *scales, p.attn_out_norm,
                                                    p.mlp_out_norm, p.cos, p.sin)), p.window, p.group)
        lm_head = _linear(model.lm_head)
        table, table_format = _embedding(model.embed_tokens)
        struct = Model(spec.hidden_size, spec.num_layers, spec.num_heads,
                        spec.num_kv_heads, spec.head_dim, spec.vocab_size, block_size, spec.rms_norm_eps,
                        plan.scale, _addr(table), _addr(plan.norm), lm_head, _addr(plan.cos),
                        _addr(plan.sin), layers, plan.embed_scale, int(plan.gelu), table_format,
                        table.shape[1] * table.element_size())
        signature = "|".join(str(x) for x in (
            f"{type(model).__name__}", f"hidden={spec.hidden_size}", f"layers={spec.num_layers}",
            f"heads={spec.num_heads}/{spec.num_kv_heads}", f"head_dim={spec.head_dim}",
            f"ffn={spec.intermediate_size}", f"vocab={spec.vocab_size}",
            "weights=" + ",".join(sorted({str(layers[0].qkv.format), str(lm_head.format)})),
            f"pool={'int8' if k_scales is not None else 'fp32'}"))
        paths = PathChoice(Path(lib._name).with_suffix(".paths.json"), signature)
        return cls(lib, struct, layers, [model, k_caches, v_caches, k_scales, v_scales, arena, plan], paths,
                   groups=1 + max(p.group for p in plan.layers), rotaries=plan.rotaries)

    def use_native(self, tokens: int, seqs: int) -> bool:
        """Whether a step of this many tokens and sequences should take the native path (measured)."""
        return self.paths.use_native(tokens, seqs, torch.get_num_threads())

    def torch_took(self, tokens: int, seqs: int, seconds: float) -> None:
        """The wall time of a step this could have run, on the torch path: for PathChoice's trials."""
        self.paths.record(tokens, seqs, torch.get_num_threads(), False, seconds)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
             cu_seqlens_q: torch.Tensor, window_tables: list[torch.Tensor] = (),
             sample_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] of a step's T tokens: sequence b's tokens are rows cu_seqlens_q[b] ..
        cu_seqlens_q[b + 1] - 1, at consecutive positions ending at its last (one for a decode step, k + 1 for a
        verify step, a chunk of its prompt for a prefill step); their K/V are written into the pool.
        sample_rows (int64, ascending): only those rows' logits, [len, vocab] (a prefill chunk samples its last
        token, if any). window_tables: the block tables of each window layer group
        (AttentionMetadata.window_metas), when the model has them."""
        assert len(window_tables) == self.groups - 1, "a model with window groups needs their block tables"
        for rotary in self.rotaries:   # their rows for these positions computed before C reads them
            rotary.positions.ensure_for(positions)
        if window_tables:
            block_tables = _stacked([block_tables, *window_tables])
        assert ids.dtype == positions.dtype == torch.int64 and block_tables.dtype == cu_seqlens_q.dtype == torch.int32
        assert block_tables.is_contiguous() and ids.is_contiguous() and positions.is_contiguous()
        B = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_q.is_contiguous() and block_tables.shape[0] == B * self.groups
        tokens, budget = ids.shape[0], torch.get_num_threads()
        if self.threads is None or self.threads.options[0] != budget:  # (the budget was changed: start over)
            self.threads = ThreadChoice(budget)
        threads = self.threads.pick(tokens)
        if sample_rows is not None:
            assert sample_rows.dtype == torch.int64 and sample_rows.is_contiguous()
        rows = tokens if sample_rows is None else sample_rows.shape[0]
        logits = torch.empty((rows, self.vocab), dtype=torch.float32)
        wall, cpu = time.perf_counter(), time.process_time()
        rc = self.lib.pc_step(ctypes.byref(self.struct), tokens, ids.data_ptr(), positions.data_ptr(),
                              B, cu_seqlens_q.data_ptr(), block_tables.data_ptr(),
                              block_tables.shape[1], logits.data_ptr(), threads,
                              -1 if sample_rows is None else rows,
                              None if sample_rows is None or rows == 0 else sample_rows.data_ptr())
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.threads.record(tokens, threads, wall, cpu)
        self.paths.record(tokens, B, budget, True, wall)
        if rc != 0:
            raise MemoryError("native decode step: no memory for its scratch buffers")
        return logits
