"""Owns the model and the K/V tensors of the pool; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from pagedchat.engine.core.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from pagedchat.engine.core.logprobs import score_prompt_chunk
from pagedchat.engine.core.scheduler import ScheduledBatch
from pagedchat.engine.core.sequence import Sequence
from pagedchat.engine.core.step_inputs import index_tensor, padded_tables, to_device, token_positions, token_slots
from pagedchat.engine.kv.caches import KVCaches, kv_bytes_per_token, kv_cache_dtype
from pagedchat.errors import SettingError
from pagedchat.kernels.triton_attention_configs import PREFILL_CLASS_LENGTHS
from pagedchat.memory import available_ram
from pagedchat.model.attention import AttentionMetadata
from pagedchat.model.loader import LoadedModel

NATIVE_RETRY_S = 1.0  # how often a runner looks for a native library still being built
# The longest prefill chunk the native step may take. Its tiles are made for few rows: a GGUF model's prompt of
# a few dozen tokens runs 3-18x faster there than on the torch path, which dequantizes every layer for the
# step, but from ~128 tokens the torch path's fp32 matmuls catch up (SmolLM2 Q4_1 / Gemma 3 Q4_K_M, 1 thread,
# 64 tokens: 0.57 / 0.59 s native, 0.93 / 1.95 s torch; 256 tokens: 2.3 / 2.3 s native, 1.5 / 2.5 s torch).
# Below it the measured path choice (native/paths.py) still decides; above it prefill stays on the torch path.
NATIVE_PREFILL_MAX = 64
log = logging.getLogger("pagedchat.engine")   # with no logging set up, warnings still reach stderr


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_dtype: str = "auto") -> int:
    """A block's K and V in every layer, stored as `kv_dtype` (quantized: scales included)."""
    spec = loaded.spec
    return block_size * kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                           kv_cache_dtype(kv_dtype, loaded.dtype))


def release_device_memory(device: torch.device) -> None:
    """Give what was freed back to the device, not only to torch's cache: collect the reference cycles that
    may still hold tensors, then free cuBLAS's per-stream workspaces (a graph's capture stream has its own)
    and the caching allocator's unused blocks."""
    gc.collect()
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private; present since torch 2.1
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, extra_bytes_per_block: int = 0,
                 layer_groups: bool = True):
        """extra_bytes_per_block: what each block also costs elsewhere (a draft model's KV for as many
        tokens), so the memory budget is split between the two by bytes per token. layer_groups=False: one
        table for every layer even in a sliding-window model (a draft's, engine/decoding/draft.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        if hasattr(self.model, "use_fused_kernels"):   # before the memory profile: it runs the same path
            self.model.use_fused_kernels(config.fused_backend(self.device.type))
        self.block_size = config.block_size
        spec = loaded.spec
        # Models with sliding-window layer groups (window_groups.py): a block holds `num_slots` layers, and
        # each layer reads the cache tensor of its slot through its group's block table.
        self.kv_groups = self.model.kv_groups() if layer_groups and hasattr(self.model, "kv_groups") else None
        num_slots = self.kv_groups.num_slots if self.kv_groups else spec.num_layers
        slots = self.kv_groups.layer_slot if self.kv_groups else range(spec.num_layers)
        config.check_kv_dtype(self.device.type)
        self.kv_dtype = kv_cache_dtype(config.kv_dtype, loaded.dtype)
        self.bytes_per_block = kv_bytes_per_block(loaded, config.block_size, config.kv_dtype) * num_slots \
            // spec.num_layers
        self.num_blocks = self._num_blocks(config, extra_bytes_per_block)
        self.kv = KVCaches.allocate(num_slots, self.num_blocks, config.block_size, spec.num_kv_heads,
                                    spec.head_dim, self.kv_dtype, self.device)
        self.k_caches, self.v_caches = self.kv.k_caches, self.kv.v_caches
        backend = "torch" if self.device.type == "cpu" else "auto"
        self.attention_layers = self.model.attention_layers()
        for layer, slot in zip(self.attention_layers, slots):
            _bind(layer, self.kv, slot)
            layer.backend = backend
        for moe in getattr(self.model, "moe_layers", list)():
            moe.backend = backend
        self.backend = backend
        # Runners whose caches are indexed by this pool's block ids too (a draft model's): every block copy
        # (copy-on-write, forks) is made in their caches as well.
        self.block_sharers: list[ModelRunner] = []
        self.graphs = None
        if self._graphs_wanted(config):
            self.graphs = DecodeGraphs.capture(self, *DecodeGraphs.rows_for(config))
        if self.device.type == "cuda":
            self._warm_prefill_kernels(config)
        # The native CPU decode step (pagedchat/native), once its library is built: the first process on a
        # machine builds it in the background and takes the torch path meanwhile.
        self.native = None
        self._native_next_try: float | None = None  # when to look for the library again; None: never
        # (it reads fp32 and int8 pools; an fp8 pool is CUDA-only)
        if self.device.type == "cpu":
            from pagedchat.native.step import NativeDecode

            if NativeDecode.supports(self.model, self.k_caches, self.v_caches, self.kv.k_scales, self.kv.v_scales,
                                     self._layer_groups()):
                self._native_next_try = 0.0
                self._bind_native()
            else:
                self._dequantize_natively()

    def _graphs_wanted(self, config: EngineConfig) -> bool:
        """CUDA graphs of the decode step: on CUDA unless turned off (a quantized pool too: the v2 Triton kernels
        read it without host syncs; a step that cannot be captured decodes eagerly)."""
        return self.device.type == "cuda" and config.cuda_graphs

    def _window_groups(self) -> int:
        return self.kv_groups.num_window_groups if self.kv_groups else 0

    def _layer_groups(self) -> tuple[int, ...] | None:
        """Each layer's block-table group, when this pool keeps window layers in groups of their own."""
        return self.kv_groups.layer_group if self._window_groups() else None

    def close(self) -> None:
        """Drop the pool's caches, the graphs and the model (Engine.close): whatever still holds the runner (the
        KV tiers do) holds no device memory. The model's layers let go of this pool's caches; a model shared
        with a newer runner keeps the caches that runner bound."""
        for sharer in self.block_sharers:
            sharer.close()
        if self.graphs is not None:
            self.graphs.close()
        ours = {id(cache) for cache in self.k_caches + self.v_caches}
        for layer in self.attention_layers:
            if id(layer.k_cache) in ours:
                layer.k_cache = layer.v_cache = torch.empty(0)
                layer.k_scale = layer.v_scale = None
        self.k_caches, self.v_caches, self.block_sharers, self.attention_layers = [], [], [], []
        self.graphs = self.native = self._native_next_try = self.model = self.loaded = self.kv = None

    def _num_blocks(self, config: EngineConfig, extra_bytes_per_block: int = 0) -> int:
        if config.num_blocks is not None:
            assert config.num_blocks > 0
            return config.num_blocks
        budget = config.kv_memory
        if budget is None and self.device.type == "cuda":
            budget = self._free_memory_budget(config)
        elif budget is None and config.kv_fraction is None:
            budget = min(CPU_DEFAULT_KV_BYTES,
                         self._usable_blocks(config) * (self.bytes_per_block + extra_bytes_per_block))
        elif budget is None:
            budget = int(available_ram() * config.kv_fraction)
        else:
            self._check_fits_memory(budget)
        num_blocks = budget // (self.bytes_per_block + extra_bytes_per_block)
        if num_blocks < 1:
            raise SettingError("kv_memory", f"{{name}} {budget} bytes holds no KV block: one block of "
                                            f"{self.block_size} tokens needs {self.bytes_per_block} bytes")
        return int(num_blocks)

    def _check_fits_memory(self, budget: int) -> None:
        """An explicit budget larger than the device can hold fails here with one line, before the allocation
        (on CPU an over-large pool is not refused by the allocator: the kernel kills the process later)."""
        if self.device.type == "cuda":
            available, where = torch.cuda.mem_get_info(self.device)[0], "free on the GPU"
        else:
            available, where = available_ram(), "of memory available"
        if budget > available:
            raise SettingError("kv_memory", f"{{name}} {_gib(budget)} is more than the {_gib(available)} {where}; "
                                            f"give a smaller size (or leave it out for the default)")

    def _usable_blocks(self, config: EngineConfig) -> int:
        """Blocks the default CPU pool can ever fill: every running sequence at the full context."""
        return -(-self.loaded.max_model_len // self.block_size) * config.max_num_seqs

    def _free_memory_budget(self, config: EngineConfig) -> int:
        """What is left for the pool after the weights and a profiled forward of a full step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(config)
        free, total = torch.cuda.mem_get_info(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        fraction = 0.9 if config.kv_fraction is None else config.kv_fraction
        graphs = DecodeGraphs.reserve_bytes(self, config) if self._graphs_wanted(config) else 0
        return int(total * fraction - (total - free) - peak_activations - graphs)

    def _bind_scratch_pool(self, num_blocks: int) -> None:
        """Point every attention layer at a throw-away one-layer pool of `num_blocks` blocks in the pool's dtype
        (with its scales when quantized): memory is measured before the real pool exists, which is bound after."""
        spec = self.loaded.spec
        scratch = KVCaches.allocate(1, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim, self.kv_dtype,
                                    self.device)
        for layer in self.model.attention_layers():
            _bind(layer, scratch, 0)

    @torch.inference_mode()
    def _profile_forward(self, config: EngineConfig) -> None:
        """One prefill of a full step's tokens into a throw-away cache, to measure activation memory."""
        num_tokens = min(config.max_num_batched_tokens, self.loaded.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        self._bind_scratch_pool(blocks)
        self._forward_prompt(num_tokens, torch.arange(num_tokens, device=self.device),
                             torch.arange(blocks, dtype=torch.int32, device=self.device))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_prefill_kernels(self, config: EngineConfig) -> None:
        """One prompt of each prefill size class through the model now (decode's are compiled by the graph
        capture): the first prompt of each size would otherwise wait seconds for Triton to compile its kernels,
        in the middle of a conversation or a timed run. They write nothing (every slot -1: the pool is live) and
        their logits are dropped; Triton's cache makes this a load, not a compile, from the second start on."""
        dev = self.device
        for length in PREFILL_CLASS_LENGTHS:
            n = min(length, config.max_num_batched_tokens, self.loaded.max_model_len)
            self._forward_prompt(n, torch.full((n,), -1, dtype=torch.long, device=dev),
                                 torch.zeros(-(-n // self.block_size), dtype=torch.int32, device=dev))
        torch.cuda.synchronize(dev)

    def _forward_prompt(self, n: int, slots: torch.Tensor, table: torch.Tensor) -> None:
        """One sequence's n-token prompt (token 0 throughout) through the model with these slots and block table,
        its logits dropped: start-up's measuring and warming forwards. (A window layer group reads the same table:
        with no window_metas, every layer takes the step's own.)"""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table[None],
                                 seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 is_decode=False, max_seq_len=n)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.model.compute_logits(self.model(ids, torch.arange(n, device=dev), meta)[-1:])

    # -- blocks in and out (the RAM and disk tiers) ----------------------------------------------------------
    @property
    def block_payload_shape(self) -> tuple[int, ...]:
        """One block as the tiers store it: its bytes in every layer (engine/kv/caches.py)."""
        return (self.kv.block_bytes,)

    block_payload_dtype = torch.uint8

    @torch.inference_mode()
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A CPU copy of these blocks, [n, *block_payload_shape]."""
        return self.kv.read_blocks(blocks)

    @torch.inference_mode()
    def write_blocks(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        self.kv.write_blocks(blocks, payloads)

    # -- one step -------------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = zip(*copies)
            for runner in [self, *self.block_sharers]:
                runner.kv.copy_blocks(list(src), list(dst), backend=self.backend)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the batch; logits only for sequences whose scheduled chunk reaches their last token
        (1 + len(draft_ids) rows for a sequence with drafts, in batch order)."""
        self.copy_blocks(batch.copies)
        ids, positions, meta, sample_rows, samplers = self._prepare(batch)
        native = self._native_fits(batch, ids, meta, sample_rows)
        if native and self.native.use_native(ids.shape[0], len(batch.items)):  # (measured: native/paths.py)
            windows = [m.block_tables for m in meta.window_metas or ()]
            every_row = len(sample_rows) == ids.shape[0]
            rows = None if every_row else torch.tensor(sample_rows, dtype=torch.int64)
            logits = self.native.step(ids, positions, meta.block_tables, meta.cu_seqlens_q, windows, rows)
            return (logits, samplers) if sample_rows else (None, [])
        start = time.perf_counter()
        if self.graphs is not None and self.graphs.fits(ids.shape[0], max(n for _, n in batch.items)):
            hidden = self.graphs.replay(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta)
        self._score_prompts(batch, hidden)
        if not sample_rows:
            return None, []
        if len(sample_rows) == hidden.shape[0]:  # every row, in order (a decode step): no copy, no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[index_tensor(sample_rows, self.device)])
        if native:
            self.native.torch_took(ids.shape[0], len(batch.items), time.perf_counter() - start)
        return logits, samplers

    def _bind_native(self) -> None:
        now = time.monotonic()
        if self._native_next_try is None or now < self._native_next_try:
            return
        from pagedchat.native import build
        from pagedchat.native.step import NativeDecode

        self.native = NativeDecode.bind(self.model, self.k_caches, self.v_caches, self.block_size,
                                        k_scales=self.kv.k_scales, v_scales=self.kv.v_scales,
                                        layer_groups=self._layer_groups())
        self._native_next_try = now + NATIVE_RETRY_S if self.native is None and build.building() else None
        if self.native is not None:
            self._dequantize_natively()

    def _dequantize_natively(self) -> None:
        """Once the native library is loaded, GGUF layers on the torch path are dequantized by it (the same
        weights bit for bit, in a fraction of the time: pagedchat/native/dequantize.py). A model without GGUF
        layers neither needs it nor starts a build for it."""
        from pagedchat.model.gguf.linear import GGUFLinear
        from pagedchat.native import build, dequantize

        if not any(isinstance(m, GGUFLinear) for m in self.model.modules()):
            return
        lib = build.load()
        if lib is not None:
            dequantize.install(lib)

    def _native_fits(self, batch: ScheduledBatch, ids: torch.Tensor, meta: AttentionMetadata,
                     sample_rows: list[int]) -> bool:
        """A step the native step can run whole: decode steps, beams, the verify steps of speculative decoding
        and prefill steps of up to NATIVE_PREFILL_MAX tokens (only their sampled rows get logits) whose every
        token has a slot in every layer group; where no prompt is scored or pooled (they need the hidden
        states) and the attention layers are still on the torch twins (tests put them on the Triton kernels to
        run those end to end)."""
        if self.native is None:
            self._bind_native()
        every_row = len(sample_rows) == ids.shape[0]
        return self.native is not None \
            and (every_row or ids.shape[0] <= NATIVE_PREFILL_MAX and _every_slot_held(meta)) \
            and all(seq.request.params.prompt_logprobs is None and not seq.request.params.embed
                    for seq, _ in batch.items) \
            and all(layer.backend == "torch" for layer in self.attention_layers)

    def _score_prompts(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Prompt log-probabilities (echo) of this step's prefill chunks, reduced per chunk: row p scores
        prompt token p + 1. A re-prefill after preemption skips the positions already scored."""
        row = 0
        for seq, n in batch.items:
            k, request = seq.request.params.prompt_logprobs, seq.request
            first = max(seq.num_computed, len(request.prompt_logprobs))
            last = min(seq.num_computed + n, seq.num_prompt_tokens - 1)
            if k is not None and first < last:
                rows = hidden[row + first - seq.num_computed: row + last - seq.num_computed]
                targets = seq.token_ids[first + 1:last + 1]
                request.prompt_logprobs.extend(score_prompt_chunk(self.model.compute_logits, rows, targets, k))
            if request.params.embed:
                self._pool_prompt(seq, hidden[row:row + n])
            row += n

    @staticmethod
    def _pool_prompt(seq: Sequence, rows: torch.Tensor) -> None:
        """Embeddings: add this chunk's prompt positions (not pooled yet) to the request's running sum."""
        request = seq.request
        first = max(seq.num_computed, request.pooled)
        last = min(seq.num_computed + rows.shape[0], seq.num_prompt_tokens)
        if first < last:
            chunk = rows[first - seq.num_computed:last - seq.num_computed].double().sum(dim=0)
            request.hidden_sum = chunk if request.hidden_sum is None else request.hidden_sum + chunk
            request.pooled = last

    def _prepare(self, batch: ScheduledBatch):
        """Flatten the batch into token, position and slot vectors: per sequence only list slicing, then
        numpy over the whole batch (per-sequence tensor ops would cost more than a small model's whole decode
        step)."""
        bs, dev = self.block_size, self.device
        ids, starts, counts, sample_rows, samplers = [], [], [], [], []
        pending_at, pending_rows = [], []  # PENDING tokens: where in `ids`, and their rows in prior_tokens
        row_end = 0
        for seq, n in batch.items:
            computed, tokens, drafts = seq.num_computed, seq.token_ids, seq.draft_ids
            end = computed + n
            if seq.pending_row is not None and end >= len(tokens):
                pending_at.append(len(ids) + len(tokens) - 1 - computed)
                pending_rows.append(seq.pending_row)
            ids += tokens[computed:end]
            if drafts:  # a sequence with drafts always has all of them scheduled
                ids += drafts
            starts.append(computed)
            counts.append(n)
            row_end += n
            if end == len(tokens) + len(drafts):  # one row per drafted position too
                sample_rows.extend(range(row_end - 1 - len(drafts), row_end))
                samplers.append(seq)
        start, count = np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64)
        seq_lens, decode = start + count, row_end == len(counts)
        if decode:  # one token a sequence: the common step, spared the general arithmetic (batch 1 on CPU)
            rows, positions, cu = np.arange(len(counts)), start, np.arange(len(counts) + 1, dtype=np.int32)
        else:
            rows = np.repeat(np.arange(len(counts)), count)  # each token's sequence
            positions = token_positions(start, count, rows)
            cu = np.concatenate(([0], np.cumsum(count))).astype(np.int32)
        tables = padded_tables([seq.block_table for seq, _ in batch.items])
        meta = AttentionMetadata(
            slot_mapping=to_device(token_slots(tables, rows, positions, bs), dev),
            block_tables=to_device(tables, dev),
            seq_lens=to_device(seq_lens.astype(np.int32), dev),
            cu_seqlens_q=to_device(cu, dev),
            is_decode=decode,
            max_seq_len=int(seq_lens.max()))
        if self._window_groups():
            meta.window_metas = [self._group_meta(batch, g, meta, rows, positions)
                                 for g in range(self._window_groups())]
        tokens = index_tensor(ids, dev)
        if pending_at:  # the previous step's tokens, still on the device
            tokens[index_tensor(pending_at, dev)] = batch.prior_tokens[index_tensor(pending_rows, dev)]
        return tokens, to_device(positions, dev), meta, sample_rows, samplers

    def _group_meta(self, batch: ScheduledBatch, group: int, meta: AttentionMetadata, rows: np.ndarray,
                    positions: np.ndarray) -> AttentionMetadata:
        """The same step seen through window group `group`'s tables (released entries are -1: never read)."""
        tables = padded_tables([seq.window_tables[group] for seq, _ in batch.items])
        return AttentionMetadata(to_device(token_slots(tables, rows, positions, self.block_size), self.device),
                                 to_device(tables, self.device), meta.seq_lens, meta.cu_seqlens_q, meta.is_decode,
                                 meta.max_seq_len)


def _every_slot_held(meta: AttentionMetadata) -> bool:
    """Whether every token of a prefill step has a slot in every layer group. A window group gives none to a
    chunk's tokens that are behind its window by the chunk's end: the torch path attends to those from the
    step's own K/V, while the native step reads all keys from the pool."""
    return all(bool((m.slot_mapping >= 0).all()) for m in [meta, *(meta.window_metas or ())])


def _bind(layer, caches: KVCaches, slot: int) -> None:
    """Point an attention layer at its slot of the pool (and at the slot's scales when quantized)."""
    for name, tensor in caches.layer(slot).items():
        setattr(layer, name, tensor)


MAX_GRAPH_ROWS = 512  # the largest captured step (rows = sequences x tokens each)


def graph_sizes(max_rows: int) -> list[int]:
    """The capture ladder: 1, 2, 4, 8, then every 16 up to 256 and every 32 up to 512 (a step is padded up to
    the next size: at most 15 padding rows up to 256, 31 above; a padding row costs its share of the matmuls'
    compute, not of their weight reads)."""
    ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(288, MAX_GRAPH_ROWS + 1, 32)]
    sizes = [b for b in ladder if b < max_rows]
    return sizes + [max_rows]


class CudaGraphCapture:
    """How DecodeGraphs records a step and replays it: CUDA graphs. Tests hand DecodeGraphs a double that
    re-runs the recorded step on its static buffers, so the buffer, padding and ladder logic runs on CPU."""

    @staticmethod
    def capture(step, pool):
        """(graph, its output tensor, the memory pool the next, smaller graph shares)."""
        step()  # warm-up: compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
        return graph, out, graph.pool()

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()


class DecodeGraphs:
    """CUDA graphs of the decode step for a ladder of row counts; a step is padded up to the next size.

    Small models are bound by launch overhead at decode; one graph replay replaces hundreds of launches.
    A row is one query token attending to its sequence's context through the sequence's block table, so the
    verify step of speculative decoding (1 + k tokens per sequence) replays the same graphs: its tokens
    become rows of k + 1 consecutive context lengths over the same table (causal by construction), and a
    short extend (a chat turn's few new tokens) does too. Padded rows write nowhere (slot -1), attend to
    nothing (length 0) and read token 0 at position 0: nothing left in a static buffer by an earlier step is
    read. The block-table width is fixed at the model's full context, so the decode kernel's split count is
    the same at capture and replay.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], max_query: int, capturer=CudaGraphCapture):
        dev, max_rows = runner.device, sizes[-1]
        max_blocks = -(-runner.loaded.max_model_len // runner.block_size)
        self.runner, self.sizes, self.max_batch, self.max_query = runner, sizes, max_rows, max_query
        self.capturer = capturer
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.slots = torch.full((max_rows,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.cu = torch.arange(max_rows + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(max_rows, dtype=torch.int32, device=dev)  # constant: a token's row index
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        # Sliding-window layer groups (Gemma): each reads its own slots and table through the same lengths.
        groups = runner._window_groups()
        self.group_slots = [torch.full_like(self.slots, -1) for _ in range(groups)]
        self.group_tables = [torch.zeros_like(self.tables) for _ in range(groups)]
        self.memory_bytes = 0  # what the graphs' memory pool holds (CUDA), counted in the pool budget

    @classmethod
    def rows_for(cls, config: EngineConfig) -> tuple[int, int]:
        """(most rows a graphed step has, most tokens of one sequence in it): speculation's verify steps take
        1 + num_draft_tokens rows per sequence (set_speculation may turn it on later: always room for it)."""
        max_query = 1 + config.num_draft_tokens
        return min(MAX_GRAPH_ROWS, config.max_num_seqs * max_query), max_query

    @classmethod
    def capture(cls, runner: ModelRunner, max_rows: int, max_query: int = 1,
                capturer=CudaGraphCapture) -> "DecodeGraphs | None":
        graphs = cls(runner, graph_sizes(max_rows), max_query, capturer)
        try:
            graphs._capture_all()
        except Exception as e:  # a model or kernel that cannot be captured still runs, just eagerly
            log.warning("pagedchat: CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            return None
        return graphs

    @classmethod
    @torch.inference_mode()
    def reserve_bytes(cls, runner: ModelRunner, config: EngineConfig) -> int:
        """What the graphs will hold, measured before the pool is sized (CUDA): their static buffers and the
        peak of one eager step at the largest size (the graphs share one memory pool, sized by the largest)."""
        rows, _ = cls.rows_for(config)
        dev = runner.device
        max_blocks = -(-runner.loaded.max_model_len // runner.block_size)
        runner._bind_scratch_pool(1)
        meta = AttentionMetadata(torch.full((rows,), -1, dtype=torch.long, device=dev),
                                 torch.zeros((rows, max_blocks), dtype=torch.int32, device=dev),
                                 torch.ones(rows, dtype=torch.int32, device=dev),
                                 torch.arange(rows + 1, dtype=torch.int32, device=dev), is_decode=True)
        tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        runner.model(tokens, tokens, meta)
        torch.cuda.synchronize(dev)
        static = rows * (max_blocks + 6) * 8
        return torch.cuda.max_memory_allocated(dev) - base + static

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(self.slots[:size], self.tables[:size], self.seq_lens[:size], self.cu[:size + 1],
                                 is_decode=True)
        if self.group_slots:
            meta.window_metas = [AttentionMetadata(slots[:size], tables[:size], meta.seq_lens, meta.cu_seqlens_q,
                                                   is_decode=True)
                                 for slots, tables in zip(self.group_slots, self.group_tables)]
        return meta

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, pool = self.runner.model, None
        on_cuda = self.runner.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.runner.device) if on_cuda else 0
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            # fresh views of the static buffers per call: the unfused rotary caches its table rows by the
            # identity of the positions tensor (a replayed graph never consults it; a CPU double re-runs this)
            def step(size=size, meta=self._meta(size)):
                return model(self.ids[:size], self.positions[:size], meta)

            graph, out, pool = self.capturer.capture(step, pool)
            self.graphs[size] = (graph, out)
        self.capturer.synchronize()
        if on_cuda:
            self.memory_bytes = torch.cuda.memory_reserved(self.runner.device) - before

    def fits(self, num_rows: int, max_query: int) -> bool:
        """Whether a step of `num_rows` tokens, at most `max_query` of one sequence, replays a graph."""
        return num_rows <= self.max_batch and max_query <= self.max_query

    def close(self) -> None:
        """Free the graphs; their private memory pool goes back to the allocator with the last of them."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows = ids.shape[0]
        size = next(s for s in self.sizes if s >= rows)
        self.ids[:rows].copy_(ids)
        self.positions[:rows].copy_(positions)
        if rows < size:  # padding rows: token 0 at position 0, written nowhere, attending to nothing
            self.ids[rows:size].zero_()
            self.positions[rows:size].zero_()
            self.seq_lens[rows:size].zero_()
        self._write_tables(rows, size, meta)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:rows]

    def _write_tables(self, rows: int, size: int, meta: AttentionMetadata) -> None:
        """Each row's slot, block table (one per window layer group too) and context length; a sequence with n
        tokens in the step gives n rows, the i-th seeing its context up to its own token (no host sync: the
        row count is known)."""
        seq = None
        if not meta.is_decode:
            cu = meta.cu_seqlens_q.long()
            seq = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu[1:] - cu[:-1],
                                          output_size=rows)
        for slots, tables, m in zip([self.slots, *self.group_slots], [self.tables, *self.group_tables],
                                    [meta, *(meta.window_metas or ())]):
            slots[:rows].copy_(m.slot_mapping)
            slots[rows:size].fill_(-1)
            width = m.block_tables.shape[1]
            tables[:rows, :width].copy_(m.block_tables if seq is None else m.block_tables[seq])
        if seq is None:
            self.seq_lens[:rows].copy_(meta.seq_lens)
        else:  # the i-th of a sequence's n tokens (i = 0..n-1) sees seq_len - (n - 1 - i) keys
            self.seq_lens[:rows].copy_(meta.seq_lens[seq] - (cu[seq + 1] - 1 - self.rows[:rows]))
