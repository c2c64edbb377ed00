"""Owns the model and the K/V tensors of the pool; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
import time

import torch

from pagedchat.engine.core.config import EngineConfig
from pagedchat.engine.core.logprobs import score_prompt_chunk
from pagedchat.engine.core.scheduler import ScheduledBatch
from pagedchat.engine.core.sequence import Sequence
from pagedchat.engine.kv.caches import KVCaches, kv_bytes_per_token, kv_cache_dtype
from pagedchat.errors import SettingError
from pagedchat.memory import available_ram
from pagedchat.model.attention import AttentionMetadata
from pagedchat.model.loader import LoadedModel

CPU_DEFAULT_KV_BYTES = 512 * 1024**2
NATIVE_RETRY_S = 1.0  # how often a runner looks for a native library still being built
log = logging.getLogger("pagedchat.engine")   # with no logging set up, warnings still reach stderr


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_dtype: str = "auto") -> int:
    """A block's K and V in every layer, stored as `kv_dtype` (quantized: scales included)."""
    spec = loaded.spec
    return block_size * kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                           kv_cache_dtype(kv_dtype, loaded.dtype))


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, extra_bytes_per_block: int = 0,
                 layer_groups: bool = True):
        """extra_bytes_per_block: what each block also costs elsewhere (a draft model's KV for as many
        tokens), so the memory budget is split between the two by bytes per token. layer_groups=False: one
        table for every layer even in a sliding-window model (a draft's, engine/decoding/draft.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
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
        # (a quantized pool decodes through the torch twins until the Triton kernels read it: their host
        # syncs cannot be captured)
        if self.device.type == "cuda" and config.cuda_graphs and not self._window_groups() and not self.kv.quantized:
            self.graphs = DecodeGraphs.capture(self, min(config.max_num_seqs, 256))
        # The native CPU decode step (pagedchat/native), once its library is built: the first process on a
        # machine builds it in the background and takes the torch path meanwhile.
        self.native = None
        self._native_next_try: float | None = None  # when to look for the library again; None: never
        # decode.c reads fp32 caches only: a quantized pool takes the torch path until it reads int8 KV too
        # (then: drop `not self.kv.quantized` here; _bind_native already passes the scales to bind)
        if self.device.type == "cpu" and not self._window_groups() and not self.kv.quantized:
            from pagedchat.native.step import NativeDecode

            if NativeDecode.supports(self.model, self.k_caches, self.v_caches):
                self._native_next_try = 0.0
                self._bind_native()

    def _window_groups(self) -> int:
        return self.kv_groups.num_window_groups if self.kv_groups else 0

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
        return int(total * fraction - (total - free) - peak_activations)

    @torch.inference_mode()
    def _profile_forward(self, config: EngineConfig) -> None:
        """One prefill of a full step's tokens into a throw-away cache, to measure activation memory."""
        num_tokens = min(config.max_num_batched_tokens, self.loaded.max_model_len)
        spec, dev = self.loaded.spec, self.device
        blocks = -(-num_tokens // self.block_size)
        scratch = KVCaches.allocate(1, blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                    kv_cache_dtype(config.kv_dtype, self.loaded.dtype), dev)
        for layer in self.model.attention_layers():
            _bind(layer, scratch, 0)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=dev),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            is_decode=False, max_seq_len=num_tokens)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self.model.compute_logits(self.model(ids, torch.arange(num_tokens, device=dev), meta)[-1:])
        torch.cuda.synchronize(dev)
        del scratch

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
        if self._native_fits(batch, meta, sample_rows):
            return self.native.step(ids, positions, meta.block_tables, meta.seq_lens), samplers
        if self.graphs is not None and meta.is_decode and len(batch.items) <= self.graphs.max_batch:
            hidden = self.graphs.replay(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta)
        self._score_prompts(batch, hidden)
        if not sample_rows:
            return None, []
        rows = torch.tensor(sample_rows, device=self.device)
        return self.model.compute_logits(hidden[rows]), samplers

    def _bind_native(self) -> None:
        now = time.monotonic()
        if self._native_next_try is None or now < self._native_next_try:
            return
        from pagedchat.native import build
        from pagedchat.native.step import NativeDecode

        self.native = NativeDecode.bind(self.model, self.k_caches, self.v_caches, self.block_size,
                                        k_scales=self.kv.k_scales, v_scales=self.kv.v_scales)
        self._native_next_try = now + NATIVE_RETRY_S if self.native is None and build.building() else None

    def _native_fits(self, batch: ScheduledBatch, meta: AttentionMetadata, sample_rows: list[int]) -> bool:
        """A plain decode step the native step can run whole: every sequence samples its one new token, no
        prompt is scored or pooled (they need the hidden states), and the attention layers are still on the
        torch twins (tests put them on the Triton kernels to run those end to end)."""
        if self.native is None and meta.is_decode:
            self._bind_native()
        return self.native is not None and meta.is_decode and len(sample_rows) == len(batch.items) \
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
        """Flatten the batch into token, position and slot vectors (built as Python lists: per-sequence
        tensor ops would cost more than a small model's whole decode step)."""
        bs, dev = self.block_size, self.device
        ids, positions, slots, seq_lens, cu, sample_rows, samplers = [], [], [], [], [0], [], []
        max_blocks = max(len(seq.block_table) for seq, _ in batch.items)
        tables = []
        for seq, n in batch.items:
            start, end, table = seq.num_computed, seq.num_computed + n, seq.block_table
            ids.extend(seq.token_ids[start:end])
            ids.extend(seq.draft_ids)  # a sequence with drafts always has all of them scheduled
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table + [0] * (max_blocks - len(table)))
            seq_lens.append(end)
            cu.append(cu[-1] + n)
            if end == seq.num_tokens + len(seq.draft_ids):  # one row per drafted position too
                sample_rows.extend(range(cu[-1] - 1 - len(seq.draft_ids), cu[-1]))
                samplers.append(seq)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            is_decode=cu[-1] == len(batch.items),
            max_seq_len=max(seq_lens))
        if self._window_groups():
            meta.window_metas = [self._group_meta(batch, g, meta) for g in range(self._window_groups())]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows, samplers)

    def _group_meta(self, batch: ScheduledBatch, group: int, meta: AttentionMetadata) -> AttentionMetadata:
        """The same step seen through window group `group`'s tables (released entries are -1: never read)."""
        bs, dev = self.block_size, self.device
        slots, tables = [], []
        width = max(len(seq.window_tables[group]) for seq, _ in batch.items)
        for seq, n in batch.items:
            table = seq.window_tables[group]
            slots.extend(table[p // bs] * bs + p % bs for p in range(seq.num_computed, seq.num_computed + n))
            tables.append(table + [0] * (width - len(table)))
        return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev),
                                 torch.tensor(tables, dtype=torch.int32, device=dev), meta.seq_lens,
                                 meta.cu_seqlens_q, meta.is_decode, meta.max_seq_len)


def _bind(layer, caches: KVCaches, slot: int) -> None:
    """Point an attention layer at its slot of the pool (and at the slot's scales when quantized)."""
    for name, tensor in caches.layer(slot).items():
        setattr(layer, name, tensor)


class DecodeGraphs:
    """CUDA graphs of the decode step for a ladder of batch sizes; a batch is padded up to the next size.

    Small models are bound by Python launch overhead at decode; one graph replay replaces hundreds of
    launches. Padded rows write nowhere (slot -1) and attend to nothing (length 0). The block-table width is
    fixed at the model's full context, so the decode kernel's split count is the same at capture and replay.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int]):
        dev, max_batch = runner.device, sizes[-1]
        max_blocks = -(-runner.loaded.max_model_len // runner.block_size)
        self.runner, self.sizes, self.max_batch = runner, sizes, max_batch
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.cu = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def capture(cls, runner: ModelRunner, max_batch: int) -> "DecodeGraphs | None":
        sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
        if not sizes or sizes[-1] < max_batch:
            sizes.append(max_batch)
        graphs = cls(runner, sizes)
        try:
            graphs._capture_all()
        except Exception as e:  # a model or kernel that cannot be captured still runs, just eagerly
            log.warning("pagedchat: CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            return None
        return graphs

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slots[:size], self.tables[:size], self.seq_lens[:size], self.cu[:size + 1],
                                 is_decode=True)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, pool = self.runner.model, None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(size)
            model(self.ids[:size], self.positions[:size], meta)  # warm-up: compiles the kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.ids[:size], self.positions[:size], meta)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = ids.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        width = meta.block_tables.shape[1]
        self.ids[:batch].copy_(ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        self.slots[batch:size].fill_(-1)
        self.tables[:batch, :width].copy_(meta.block_tables)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(0)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:batch]
