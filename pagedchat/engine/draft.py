"""Draft-model proposals for speculative decoding (see speculative.py).

A smaller model with the same tokenizer proposes k tokens greedily, one batched forward per token. It keeps
its own KV: its own layer caches and, per target sequence, a shadow sequence with its own block table, in a
block pool with as many blocks as the target's (the KV budget is split between the two by bytes per token:
see ModelRunner's extra_bytes_per_block). After verification the shadow keeps the KV of the tokens it fed that
the target accepted and recomputes the rest; shadows of sequences that stopped running are freed.
"""

from __future__ import annotations

from dataclasses import replace

from pagedchat.engine.block_pool import BlockPool
from pagedchat.engine.config import EngineConfig
from pagedchat.engine.runner import ModelRunner
from pagedchat.engine.scheduler import ScheduledBatch
from pagedchat.engine.sequence import Sequence, SeqStatus
from pagedchat.errors import UserError
from pagedchat.model.loader import LoadedModel, load_model


def load_draft(config: EngineConfig, target: LoadedModel, show_progress: bool) -> LoadedModel:
    """Load the draft model on the target's device and dtype; refuse one whose tokenizer differs."""
    draft = load_model(config.draft_model, config.device, config.dtype, target.max_model_len,
                       show_progress=show_progress)
    _check_same_tokenizer(draft, target)
    return draft


def _check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    name = f"draft model {draft.path}"
    if draft.tokenizer is not None and target.tokenizer is not None:
        dv, tv = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
        if dv != tv:
            differ = len(set(dv.items()) ^ set(tv.items()))
            raise UserError(f"{name} does not use the target's tokenizer ({len(dv)} vs {len(tv)} tokens, {differ} "
                            f"entries differ): a draft must share it exactly")
    elif draft.spec.vocab_size != target.spec.vocab_size:
        raise UserError(f"{name} has a vocabulary of {draft.spec.vocab_size} tokens, the target "
                        f"{target.spec.vocab_size}: a draft must share the target's tokenizer")


class DraftProposer:
    can_shadow = False  # guessing costs a draft forward: sequences at k = 0 are probed now and then instead

    def __init__(self, draft: LoadedModel, config: EngineConfig, num_blocks: int, target_vocab: int):
        self.loaded = draft
        self.runner = ModelRunner(draft, replace(config, model=str(draft.path), num_blocks=num_blocks,
                                                 cuda_graphs=False))
        self.pool = BlockPool(num_blocks, config.block_size, enable_prefix_cache=False)
        self.block_size = config.block_size
        self.target_vocab = target_vocab
        # target seq_id -> (target, shadow, how many leading tokens of the shadow are surely the target's)
        self.shadows: dict[int, tuple[Sequence, Sequence, int]] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self._free_stopped()
        live = {}
        for seq, k in zip(seqs, ks):
            shadow = self._sync(seq)
            # it writes its catch-up tokens and k - 1 proposals: up to position num_tokens + k - 2
            if seq.num_tokens + k <= self.loaded.max_model_len and self._reserve(shadow, seq.num_tokens + k - 1):
                live[seq.seq_id] = (shadow, k)
            else:
                self._free(seq.seq_id)  # no room in the draft pool (or its context): no drafts this step
        for step in range(max((k for _, k in live.values()), default=0)):
            self._forward([shadow for shadow, k in live.values() if step < k])
        return [self._drafts(seq, live.get(seq.seq_id)) for seq in seqs]

    # -- shadows --------------------------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its tokens replaced by seq's and its computed count cut back to the tokens it
        fed that are still there (its rejected proposals are recomputed)."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(seq.request, seq.index, seq.token_ids)
            self.shadows[seq.seq_id] = (seq, shadow, seq.num_tokens)
            return shadow
        _, shadow, synced = entry  # up to `synced` its tokens are seq's own, copied at the last sync
        limit = min(shadow.num_computed, seq.num_tokens - 1)
        valid = min(synced, limit)
        while valid < limit and shadow.token_ids[valid] == seq.token_ids[valid]:
            valid += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed = valid
        self.shadows[seq.seq_id] = (seq, shadow, seq.num_tokens)
        keep = -(-valid // self.block_size)
        for block in reversed(shadow.block_table[keep:]):
            self.pool.decref(block)
        del shadow.block_table[keep:]
        return shadow

    def _reserve(self, shadow: Sequence, num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` positions of the shadow."""
        needed = -(-num_tokens // self.block_size) - len(shadow.block_table)
        if needed > self.pool.num_free:
            return False
        for _ in range(needed):
            shadow.block_table.append(self.pool.allocate())
        return True

    def _forward(self, shadows: list[Sequence]) -> None:
        """One draft forward: each shadow computes its uncomputed tokens and appends its greedy next one."""
        batch = ScheduledBatch(items=[(s, s.num_tokens - s.num_computed) for s in shadows])
        logits, samplers = self.runner.run(batch)
        for shadow, n in batch.items:
            shadow.num_computed += n
        for shadow, token in zip(samplers, logits.argmax(dim=-1).tolist()):
            shadow.token_ids.append(token)

    def _drafts(self, seq: Sequence, entry) -> list[int]:
        if entry is None:
            return []
        shadow, k = entry
        drafts = shadow.token_ids[seq.num_tokens:seq.num_tokens + k]
        for i, token in enumerate(drafts):  # a draft's padded vocabulary rows are no target token
            if token >= self.target_vocab:
                return drafts[:i]
        return drafts

    def _free(self, seq_id: int) -> None:
        entry = self.shadows.pop(seq_id, None)
        if entry is not None:
            self.pool.free_table(entry[1].block_table)

    def _free_stopped(self) -> None:
        for seq_id, (seq, _, _) in list(self.shadows.items()):
            if seq.status != SeqStatus.RUNNING or seq.num_computed != seq.num_tokens - 1:
                self._free(seq_id)

    def tables(self) -> list[list[int]]:
        return [shadow.block_table for _, shadow, _ in self.shadows.values()]
