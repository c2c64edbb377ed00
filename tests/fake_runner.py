"""A model-free runner: it records which token each KV slot holds, so tests can prove that sharing,
copy-on-write, prefix reuse and preemption never put the wrong token's KV under a sequence."""

from __future__ import annotations

import torch

from pagedchat.engine import Engine, EngineConfig
from pagedchat.engine.seams import NoModel

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
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, vocab, generator=gen)  # logits depend on the last token only

    def run(self, batch):
        pool = self.pool
        for src, dst in batch.copies:
            self.content[dst] = list(self.content[src])
        samplers, rows = [], []
        for seq, n in batch.items:
            tokens = seq.token_ids + seq.draft_ids  # drafts are always scheduled whole, after the last token
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


def fake_tiers(runner: ContentRunner, ram_bytes: int, disk_dir=None, disk_bytes: int = 1 << 20):
    """RAM and disk tiers over the fake runner's blocks (their payload is the token ids they hold)."""
    from pagedchat.engine.kv_disk import DiskTier
    from pagedchat.engine.kv_ram import RamTier
    from pagedchat.engine.kv_tiers import KVTiers

    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, "fake", disk_bytes, runner.block_payload_shape, torch.int64, warn=print)
    return KVTiers(runner, RamTier(ram_bytes) if ram_bytes else None, disk)


def fake_engine(num_blocks=32, block_size=8, vocab=24, max_model_len=256, window_groups=None, tiers=None,
                **config) -> tuple[Engine, ContentRunner]:
    """`tiers`: fake_tiers keyword arguments (ram_bytes, disk_dir, ...) to put RAM/disk tiers under the pool."""
    loaded = NoModel(max_model_len=max_model_len, vocab_size=vocab, eos_token_ids=[EOS], path="fake")
    runner = ContentRunner(num_blocks, block_size, vocab, window_groups)
    engine = Engine(EngineConfig(model="fake", block_size=block_size, num_blocks=num_blocks, **config),
                    loaded=loaded, runner=runner, tiers=fake_tiers(runner, **tiers) if tiers else None)
    runner.pool = engine.pool
    return engine, runner
