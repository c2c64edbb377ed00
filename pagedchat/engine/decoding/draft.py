"""Draft-model proposals for speculative decoding (see speculative.py).

A smaller model with the same tokenizer proposes k tokens greedily, one batched forward per token. Its KV
lives in the target's block pool, as vLLM keeps a draft's layers: the draft's runner has its own layer caches
with one slot per block of the ONE pool (the engine's), so a block id holds the target's KV in the target's
caches and the draft's KV in the draft's (the memory budget is split by bytes per token: ModelRunner's
extra_bytes_per_block). The draft has no allocator, no refcounts and no block tables of its own: the shadow
sequence that feeds it reads its target's block table, the live list, so position p of the draft's KV is at
the slot the target's table gives position p.

The scheduler makes that table cover the verify step's positions and copies shared blocks before the draft
writes (Scheduler.reserve_for_drafts; the runner copies the draft's caches with the target's). A shadow's
`num_computed` says how many leading positions hold its KV; it is cut back to the tokens its target still
has, and to 0 when the target's blocks were all released since (preemption, abort: `kv_resets`). A new
target sequence (a fork, n variants, a prefix-cache or RAM/disk tier hit) starts a new shadow at 0: a hit block
may hold no draft KV, or another sequence's rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pagedchat.engine.kv.block_pool import BlockPool
from pagedchat.engine.core.config import EngineConfig
from pagedchat.engine.core.runner import ModelRunner
from pagedchat.engine.core.scheduler import ScheduledBatch, Scheduler
from pagedchat.engine.core.sequence import Sequence, SeqStatus
from pagedchat.engine.decoding.sampler import first_max
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


def draft_runner(draft: LoadedModel, config: EngineConfig, target_runner: ModelRunner) -> ModelRunner:
    """The draft's runner: layer caches with a slot for every block of the target's pool, copied whenever the
    target's blocks are. Every draft layer reads the one table it is given (a sliding-window draft applies
    its windows in attention: it keeps no window tables, which would need blocks of their own)."""
    runner = ModelRunner(draft, replace(config, model=str(draft.path), num_blocks=target_runner.num_blocks,
                                        cuda_graphs=False), layer_groups=False)
    target_runner.block_sharers.append(runner)
    return runner


@dataclass
class Shadow:
    target: Sequence
    seq: Sequence     # the draft's view: the target's tokens + its proposals, the target's block table
    synced: int       # up to here its tokens are the target's, copied at the last sync
    resets: int       # the target's kv_resets then: a change means its blocks were released since

    @property
    def released(self) -> bool:
        """The target's blocks were released since the shadow began: none of its draft KV is left."""
        return self.resets != self.target.kv_resets


class DraftProposer:
    can_shadow = False  # guessing costs a draft forward: sequences at k = 0 are probed now and then instead

    def __init__(self, runner, scheduler: Scheduler, copy_blocks: Callable[[list[tuple[int, int]]], None],
                 target_vocab: int, max_model_len: int):
        """runner: the draft's (draft_runner; tests give a model-free one); copy_blocks: the target runner's,
        which copies the draft's caches too."""
        self.runner = runner
        self.scheduler = scheduler
        self.copy_blocks = copy_blocks
        self.block_size = scheduler.block_size
        self.target_vocab = target_vocab
        self.max_model_len = max_model_len
        self.shadows: dict[int, Shadow] = {}  # by target seq_id

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self._drop_stopped()
        # the draft writes its catch-up tokens and k - 1 proposals (up to position num_tokens + k - 2), the
        # verify step k + 1 positions from the target's last token: the table must hold them all first
        ks = [k if seq.num_tokens + k <= self.max_model_len else 0 for seq, k in zip(seqs, ks)]
        ks, copies = self.scheduler.reserve_for_drafts(seqs, ks)
        self.copy_blocks(copies)  # on the device before the draft reads or writes the copied blocks
        live = [(self._sync(seq), k) for seq, k in zip(seqs, ks) if k]
        for step in range(max((k for _, k in live), default=0)):
            self._forward([shadow for shadow, k in live if step < k])
        for shadow, _ in live:
            self._keep_held(shadow)
        drafts = {shadow.target.seq_id: self._drafts(shadow, k) for shadow, k in live}
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    # -- shadows --------------------------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Shadow:
        """The shadow of `seq`, its tokens replaced by seq's, its computed count cut back to the positions
        that still hold its KV (its rejected proposals are recomputed), its table seq's live one."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None or shadow.released:
            shadow = Shadow(seq, Sequence(seq.request, seq.index, seq.token_ids), seq.num_tokens, seq.kv_resets)
            self.shadows[seq.seq_id] = shadow
        else:
            shadow.seq.num_computed = self._valid(shadow)
            shadow.seq.token_ids = list(seq.token_ids)
            shadow.synced = seq.num_tokens
        shadow.seq.block_table = seq.block_table
        return shadow

    @staticmethod
    def _valid(shadow: Shadow) -> int:
        """Leading positions whose draft KV is right for the target's tokens now: fed by the shadow, of tokens
        the target still has, and computed by the target (so their blocks are the table's, never rolled back)."""
        target, seq = shadow.target, shadow.seq
        if shadow.released:
            return 0
        limit = min(seq.num_computed, target.num_computed, target.num_tokens - 1)
        valid = min(shadow.synced, limit)
        while valid < limit and seq.token_ids[valid] == target.token_ids[valid]:
            valid += 1
        return valid

    def _keep_held(self, shadow: Shadow) -> None:
        """Trust only the positions in blocks the target already holds (those of its computed tokens, the
        partial one included): they change only by a copy-on-write (copied) or a release (`kv_resets`). The
        blocks just reserved for this step may be given back unverified (Scheduler._give_back_unverified)
        and the same token computed later in another block; the draft recomputes that part (at most k - 1
        positions, once per block boundary)."""
        held = -(-shadow.target.num_computed // self.block_size) * self.block_size
        shadow.seq.num_computed = min(shadow.seq.num_computed, held)

    def _forward(self, shadows: list[Shadow]) -> None:
        """One draft forward: each shadow computes its uncomputed tokens and appends its greedy next one.
        Positions before the target's computed frontier may lie in full blocks shared with other sequences
        (n variants, forks, prefix-cache hits): writing them is safe, since sharing a full block means the
        same tokens after the same prefix, so the same model writes the same values (up to the rounding of
        another batch). The partial block and everything after it are private (reserve_for_drafts)."""
        batch = ScheduledBatch(items=[(s.seq, s.seq.num_tokens - s.seq.num_computed) for s in shadows])
        logits, samplers = self.runner.run(batch)
        for seq, n in batch.items:
            seq.num_computed += n
        for seq, token in zip(samplers, first_max(logits).tolist()):
            seq.token_ids.append(token)

    def _drafts(self, shadow: Shadow, k: int) -> list[int]:
        start = shadow.target.num_tokens
        drafts = shadow.seq.token_ids[start:start + k]
        for i, token in enumerate(drafts):  # a draft's padded vocabulary rows are no target token
            if token >= self.target_vocab:
                return drafts[:i]
        return drafts

    def _drop_stopped(self) -> None:
        for seq_id, shadow in list(self.shadows.items()):
            if shadow.target.status != SeqStatus.RUNNING or shadow.released:
                del self.shadows[seq_id]

    def check_invariants(self, pool: BlockPool) -> None:
        """The draft holds no blocks: each shadow's KV that counts lies in blocks its live target holds."""
        bs = self.block_size
        for shadow in self.shadows.values():
            target = shadow.target
            if target.status != SeqStatus.RUNNING or shadow.released:
                continue
            valid = self._valid(shadow)
            assert valid <= target.num_computed and -(-valid // bs) <= len(target.block_table), \
                f"draft KV of {target} outside its table"
            assert all(pool.ref_count[b] > 0 for b in target.block_table[:-(-valid // bs)])
