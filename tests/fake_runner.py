"""A model-free runner: it records which token each KV slot holds, so tests can prove that sharing,
copy-on-write, prefix reuse and preemption never put the wrong token's KV under a sequence."""

from __future__ import annotations

import torch

from pagedchat.engine import Engine, EngineConfig
from pagedchat.engine.core.seams import NoModel

EOS = 1


class ContentRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int, window_groups=None):
        self.num_blocks, self.block_size, self.vocab = num_blocks, block_size, vocab
        self.kv_groups = None
        if window_groups:  # (number of window groups, window): a model whose window layers release blocks
            from pagedchat.model.kv_groups import KVGroups

            self.kv_groups = KVGroups(1, (0,), (0,), *window_groups)
        self.content = [[None] * block_size for _ in range(num_blocks)]
        self.pool = None            # the engine's pool, given once the engine exists (to check refcounts)
        self.block_sharers = []     # a draft's runner over the same block ids (FakeDraftRunner)
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, vocab, generator=gen)  # logits depend on the last token only

    def copy_blocks(self, copies):
        for runner in [self, *self.block_sharers]:
            for src, dst in copies:
                runner.content[dst] = list(runner.content[src])

    def run(self, batch):
        pool = self.pool
        self.copy_blocks(batch.copies)
        samplers, rows = [], []
        for seq, n in batch.items:
            # drafts are always scheduled whole, after the last token; a PENDING token is read from the step
            # still in flight (overlapped steps)
            tokens = batch.token_ids(seq) + seq.draft_ids
            for table in [seq.block_table] + seq.window_tables:
                for p in range(seq.num_computed, seq.num_computed + n):
                    block = table[p // self.block_size]
                    assert block >= 0, f"{seq}: write into a released window block"
                    assert pool.ref_count[block] == 1, f"write into shared block {block} (refcount {pool.ref_count[block]})"
                    self.content[block][p % self.block_size] = tokens[p]
            if seq.num_computed + n == len(tokens):
                samplers.append(seq)
                rows.extend(tokens[len(tokens) - 1 - len(seq.draft_ids):])
        if not samplers:
            return None, []
        return self.table[torch.tensor(rows)], samplers

    # the tiers' view of a block: its token ids, -1 where nothing was written
    block_payload_shape = property(lambda self: (self.block_size,))
    block_payload_dtype = torch.int64

    def read_blocks(self, blocks):
        return torch.tensor([[-1 if t is None else t for t in self.content[b]] for b in blocks], dtype=torch.int64)

    def write_blocks(self, blocks, payloads):
        for b, row in zip(blocks, payloads):
            self.content[b] = [None if t < 0 else t for t in row.tolist()]

    def check_sequence(self, seq) -> None:
        for p in range(seq.num_computed):
            got = self.content[seq.block_table[p // self.block_size]][p % self.block_size]
            assert got == seq.token_ids[p], f"{seq}: slot of token {p} holds {got}, expected {seq.token_ids[p]}"
        if self.kv_groups:
            self.check_window_tables(seq)

    def check_window_tables(self, seq) -> None:
        """Every window group: blocks wholly behind the window released, the rest live and holding the
        right tokens, so the next query (position >= num_computed) finds each key it can see."""
        bs, window = self.block_size, self.kv_groups.window
        dead = max(0, seq.num_computed - window) // bs     # one token of slack: a fork may step back one
        assert len(seq.window_tables) == self.kv_groups.num_window_groups or not seq.block_table
        for table in seq.window_tables:
            assert len(table) == len(seq.block_table), f"{seq}: window table {table} out of step"
            for i, block in enumerate(table[:-(-seq.num_computed // bs)]):
                assert (block < 0) == (i < dead), f"{seq}: window block {i} of {table} (dead below {dead})"
            for p in range(dead * bs, seq.num_computed):
                got = self.content[table[p // bs]][p % bs]
                assert got == seq.token_ids[p], f"{seq}: window slot of token {p} holds {got}"


class QuantizedContentRunner(ContentRunner):
    """The content runner over a real int8 pool (engine/kv/caches.py: 2 layers, 1 KV head): every token the
    model-free step writes is also written as K and V through the kernels (token t: K holds t + 1 at index
    t % D, V holds -(t + 1) at (t + 3) % D, zeros elsewhere), and the pool's own block copies and payloads
    move them. `check_kv` reads every written slot back as values x scales: a copy, fork or tier round trip
    that left the scales (or the values) behind decodes another token than the one recorded."""

    HEAD_DIM = 8

    def __init__(self, num_blocks: int, block_size: int, vocab: int):
        from pagedchat.engine.kv.caches import KVCaches

        super().__init__(num_blocks, block_size, vocab)
        self.kv = KVCaches.allocate(2, num_blocks, block_size, 1, self.HEAD_DIM, torch.int8, torch.device("cpu"))
        for scales in self.kv.k_scales + self.kv.v_scales:
            scales.zero_()  # scale 0: a slot never written (content None)

    def _vectors(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(tokens)
        k, v = torch.zeros(len(tokens), 1, self.HEAD_DIM), torch.zeros(len(tokens), 1, self.HEAD_DIM)
        k[torch.arange(len(tokens)), 0, t % self.HEAD_DIM] = (t + 1).float()
        v[torch.arange(len(tokens)), 0, (t + 3) % self.HEAD_DIM] = -(t + 1).float()
        return k, v

    def decoded(self) -> list[list[int | None]]:
        """The tokens every block's K and V say it holds (every layer must agree; None: never written)."""
        from pagedchat.kernels.kv_quant import dequantize_kv

        layers = []
        for layer in range(2):
            k, v = (dequantize_kv(values, scales, torch.float32)[..., 0, :] for values, scales in
                    ((self.kv.k_caches[layer], self.kv.k_scales[layer]), (self.kv.v_caches[layer], self.kv.v_scales[layer])))
            written = k.abs().amax(-1) > 0
            t = k.amax(-1).round().long() - 1
            agree = (k.argmax(-1) == t % self.HEAD_DIM) & (v.argmin(-1) == (t + 3) % self.HEAD_DIM) \
                & ((-v.amin(-1)).round().long() - 1 == t)
            assert (agree | ~written).all(), f"layer {layer}: K and V of a slot disagree"
            layers.append(torch.where(written, t, -1))
        assert torch.equal(layers[0], layers[1]), "the layers hold different tokens"
        return [[None if x < 0 else x for x in row] for row in layers[0].tolist()]

    def run(self, batch):
        from pagedchat import kernels

        result = super().run(batch)   # copies first (the pool's too), then records what it writes
        slots, written = [], []
        for seq, n in batch.items:
            tokens = batch.token_ids(seq) + seq.draft_ids
            for p in range(seq.num_computed, seq.num_computed + n):
                slots.append(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size)
                written.append(tokens[p])
        if slots:
            k, v = self._vectors(written)
            for layer in range(2):
                kernels.write_kv(k, v, **self.kv.layer(layer), slot_mapping=torch.tensor(slots))
        return result

    def copy_blocks(self, copies):
        super().copy_blocks(copies)
        if copies:
            src, dst = zip(*copies)
            self.kv.copy_blocks(list(src), list(dst))

    block_payload_shape = property(lambda self: (self.kv.block_bytes,))
    block_payload_dtype = torch.uint8

    def read_blocks(self, blocks):
        return self.kv.read_blocks(blocks)

    def write_blocks(self, blocks, payloads):
        self.kv.write_blocks(blocks, payloads)
        decoded = self.decoded()
        for b in blocks:
            self.content[b] = decoded[b]

    def check_kv(self) -> None:
        """Every block's KV decodes to the tokens recorded for it."""
        for block, tokens in enumerate(self.decoded()):
            assert tokens == self.content[block], f"block {block}: KV {tokens} but {self.content[block]} were written"


class FakeDraftRunner:
    """A model-free draft over the target's block ids (engine/decoding/draft.py): it records which token each slot of
    its own cache holds, checks that every position it reads holds its shadow's token (its KV is right, not
    only harmless) and that it writes only into blocks of the target's live table that are private or full
    with the same tokens, and proposes from its own next-token table."""

    def __init__(self, target: ContentRunner, table: torch.Tensor):
        self.target, self.table, self.block_size = target, table, target.block_size
        self.content = [[None] * target.block_size for _ in range(target.num_blocks)]
        self.proposer = None  # the DraftProposer (to find each shadow's target sequence)
        self.writes = 0
        target.block_sharers.append(self)

    def run(self, batch):
        targets = {id(s.seq): s.target for s in self.proposer.shadows.values()}
        bs, pool, rows = self.block_size, self.target.pool, []
        for seq, n in batch.items:
            target = targets[id(seq)]
            assert seq.block_table is target.block_table, f"the draft of {target} reads a stale table"
            for p in range(seq.num_computed):
                got = self.content[seq.block_table[p // bs]][p % bs]
                assert got == seq.token_ids[p], f"draft KV of {target} at {p} holds {got}, not {seq.token_ids[p]}"
            for p in range(seq.num_computed, seq.num_computed + n):
                block = seq.block_table[p // bs]
                shared_full = p // bs < target.num_computed // bs and \
                    self.target.content[block][p % bs] == seq.token_ids[p]
                assert pool.ref_count[block] == 1 or shared_full, f"draft write into shared block {block}"
                self.content[block][p % bs] = seq.token_ids[p]
                self.writes += 1
            rows.append(seq.token_ids[-1])
        return self.table[torch.tensor(rows)], [seq for seq, _ in batch.items]

    def check_shadows(self) -> None:
        """Every shadow's KV that counts holds its tokens, in blocks of its target's table."""
        for shadow in self.proposer.shadows.values():
            if shadow.resets == shadow.target.kv_resets:
                for p in range(self.proposer._valid(shadow)):
                    got = self.content[shadow.target.block_table[p // self.block_size]][p % self.block_size]
                    assert got == shadow.target.token_ids[p], f"draft KV of {shadow.target} at {p} holds {got}"


def fake_draft(engine, runner: ContentRunner, num_draft_tokens: int, disagree: float = 0.3, seed: int = 1):
    """Switch a fake engine to a model-free draft in its pool: the target's next-token table with a share of
    rows replaced (those drafts are rejected). Returns the FakeDraftRunner."""
    from pagedchat.engine.decoding.draft import DraftProposer
    from pagedchat.engine.decoding.speculative import Speculator

    gen = torch.Generator().manual_seed(seed)
    table = runner.table.clone()
    rows = torch.rand(runner.vocab, generator=gen) < disagree
    table[rows] = torch.randn(int(rows.sum()), runner.vocab, generator=gen)
    draft = FakeDraftRunner(runner, table)
    proposer = DraftProposer(draft, engine.scheduler, runner.copy_blocks, runner.vocab, engine.max_model_len)
    draft.proposer = proposer
    engine.speculator = engine._speculators["draft"] = Speculator("draft", num_draft_tokens, proposer,
                                                                  engine.max_model_len)
    return draft


def fake_tiers(runner: ContentRunner, ram_bytes: int, disk_dir=None, disk_bytes: int = 1 << 20):
    """RAM and disk tiers over the fake runner's blocks (their payload is the token ids they hold)."""
    from pagedchat.engine.kv.disk import DiskTier
    from pagedchat.engine.kv.ram import RamTier
    from pagedchat.engine.kv.tiers import KVTiers

    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, "fake", disk_bytes, runner.block_payload_shape, runner.block_payload_dtype,
                        warn=print)
    return KVTiers(runner, RamTier(ram_bytes) if ram_bytes else None, disk)


def fake_engine(num_blocks=32, block_size=8, vocab=24, max_model_len=256, window_groups=None, tiers=None,
                **config) -> tuple[Engine, ContentRunner]:
    """`tiers`: fake_tiers keyword arguments (ram_bytes, disk_dir, ...) to put RAM/disk tiers under the pool;
    kv_dtype="int8": the tokens also go through a real quantized pool (QuantizedContentRunner)."""
    loaded = NoModel(max_model_len=max_model_len, vocab_size=vocab, eos_token_ids=[EOS], path="fake")
    if config.get("kv_dtype", "auto") == "auto":
        runner = ContentRunner(num_blocks, block_size, vocab, window_groups)
    else:
        assert window_groups is None
        runner = QuantizedContentRunner(num_blocks, block_size, vocab)
    engine = Engine(EngineConfig(model="fake", block_size=block_size, num_blocks=num_blocks, **config),
                    loaded=loaded, runner=runner, tiers=fake_tiers(runner, **tiers) if tiers else None)
    runner.pool = engine.pool
    return engine, runner
