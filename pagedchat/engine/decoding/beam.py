"""Beam search on the paged pool: W live beams per request, chosen exactly as transformers' beam search does.

Every live beam is an ordinary sequence: the scheduler runs it mixed with every other request, and its
next-token logits are parked here until all of its siblings have theirs. Then one beam step ranks the best
K = max(2, 1 + number of stop tokens) * W continuations by cumulative log-probability (K = 1 for W = 1,
which transformers runs as greedy search). Continuations that end (a stop token, a stop string, the length
limit) among the top W become finished hypotheses, scored sum_logprob / generated_length ** length_penalty
and kept (the best W) until the search ends; the best W that go on are the next beams.

The memory story: a beam chosen once continues in place; chosen again, it is forked (its block table is
shared, refcounts + 1, and the first write copies only the partial last block); a beam chosen by no one frees
its blocks at once. So W beams over a long prompt hold the prompt once plus their short divergent tails.

Preemption: a beam whose logits are already parked needs no KV until it is chosen, so the scheduler parks it
(blocks freed, no re-prefill); a beam preempted mid-way recomputes from the prefix cache. Either way the
logits, and so the result, are those of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedchat.engine.core.sequence import Request, Sequence, SeqStatus

NEG = -1.0e9  # transformers' "never pick this" offset: kept bit for bit, ties and all


@dataclass
class Hypothesis:
    output_ids: list[int]
    finish_reason: str        # stop | length


class BeamSearch:
    def __init__(self, request: Request, stop_ids: set[int], max_length: int, tokenizer):
        params = request.params
        self.request, self.tokenizer = request, tokenizer
        self.width = params.beam_width
        self.length_penalty, self.early_stopping = params.length_penalty, params.early_stopping
        self.stop_ids, self.stop_strings = stop_ids, params.stop
        self.num_candidates = 1 if self.width == 1 else max(2, 1 + len(stop_ids)) * self.width
        self.prompt_len, self.max_length = request.num_prompt_tokens, max_length
        self.beams: list[Sequence] = []          # live, in transformers' beam order
        self.scores = torch.full((self.width,), NEG)
        self.scores[0] = 0.0                     # the W starting copies of the prompt: only the first counts
        self.finished_scores = torch.full((self.width,), NEG)
        self.finished: list[Hypothesis | None] = [None] * self.width
        self.improvable = True
        self.logits: dict[int, torch.Tensor] = {}
        self.done = False

    # -- gathering a step's logits ------------------------------------------------------------------------
    def offer(self, seq: Sequence, logits: torch.Tensor) -> None:
        self.logits[seq.seq_id] = logits.float().cpu()

    def is_ready(self) -> bool:
        return all(b.seq_id in self.logits for b in self.beams)

    # -- one beam step --------------------------------------------------------------------------------------
    def select(self) -> list[tuple[Sequence, int]]:
        """Rank the continuations, keep the finished ones, return the next beams as (parent, token)."""
        rows = self.beams if len(self.beams) == self.width else self.beams * self.width
        logits = torch.stack([self.logits[s.seq_id] for s in rows])
        self.logits.clear()
        vocab, cur_len = logits.shape[-1], rows[0].num_tokens
        log_probs = (logits.log_softmax(dim=-1) + self.scores[:, None]).reshape(-1)
        top, index = torch.topk(log_probs, k=self.num_candidates)
        parents, tokens = (index // vocab).tolist(), (index % vocab).tolist()
        ends = [self._end_reason(rows[p], t, cur_len) for p, t in zip(parents, tokens)]
        hits = torch.tensor([e is not None for e in ends])
        running = top + hits.to(torch.float32) * NEG
        keep = torch.topk(running, k=self.width)[1]
        self._update_finished(top, hits, ends, [rows[p] for p in parents], tokens, cur_len)
        self.scores = running[keep]
        self._check_done(cur_len + 1, bool(hits.all()))
        return [(rows[parents[k]], tokens[k]) for k in keep.tolist()]

    def _end_reason(self, parent: Sequence, token: int, cur_len: int) -> str | None:
        if token in self.stop_ids or self.stop_strings and self._stop_at(parent.output_ids + [token]) >= 0:
            return "stop"
        return "length" if cur_len + 1 >= self.max_length else None

    def _stop_at(self, output_ids: list[int]) -> int:
        text = self.decode(output_ids)
        return min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)

    def _update_finished(self, top, hits, ends, parents, tokens, cur_len: int) -> None:
        """Only the top W continuations may finish; the finished list keeps the best W scores seen."""
        just = hits.clone()
        just[self.width:] = False
        scores = top / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        scores += (~just) * NEG
        merged = torch.cat((self.finished_scores, scores))
        best = torch.topk(merged, k=self.width)[1].tolist()
        hypotheses = []
        for i in best:
            if i < self.width:
                hypotheses.append(self.finished[i])
            else:
                c = i - self.width
                hypotheses.append(Hypothesis(parents[c].output_ids + [tokens[c]], ends[c]) if just[c] else None)
        self.finished, self.finished_scores = hypotheses, merged[best]

    def _check_done(self, cur_len: int, all_ended: bool) -> None:
        """transformers' stopping rule: no running beam can still beat the worst finished hypothesis, or
        (early_stopping=True) W hypotheses are finished, or every continuation just ended."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = cur_len - self.prompt_len
        best_running = self.scores[:1] / (best_length ** self.length_penalty)
        is_finished = torch.tensor([h is not None for h in self.finished])
        worst = torch.where(is_finished, torch.min(self.finished_scores), NEG)
        self.improvable = self.improvable and bool(torch.any(best_running > worst))
        all_full = bool(is_finished.all()) and self.early_stopping is True
        self.done = not self.improvable or all_full or all_ended

    # -- results --------------------------------------------------------------------------------------------
    def decode(self, output_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(output_ids, skip_special_tokens=True)

    def results(self) -> list[Sequence]:
        """The finished hypotheses, best first, as finished sequences of the request."""
        out = []
        for score, hyp in zip(self.finished_scores.tolist(), self.finished):
            if hyp is None:
                continue
            seq = Sequence(self.request, len(out), self.request.prompt_token_ids + hyp.output_ids)
            seq.status, seq.finish_reason, seq.score = SeqStatus.FINISHED, hyp.finish_reason, score
            seq.text = self.decode(hyp.output_ids)
            cut = self._stop_at(hyp.output_ids) if self.stop_strings else -1
            if cut >= 0:
                seq.text = seq.text[:cut]
            out.append(seq)
        return out


def next_beams(search: BeamSearch, picks: list[tuple[Sequence, int]], scheduler) -> list[Sequence]:
    """Turn the chosen (parent, token) pairs into live beams: the first pick of a parent continues it in
    place, later picks fork it, and a parent nobody picked is finished now (its blocks freed at once)."""
    picked = {id(parent) for parent, _ in picks}
    for seq in search.beams:
        if id(seq) not in picked and not seq.is_finished:
            seq.finish_reason = "stop"
            scheduler.finish(seq, keep=False)
    used, plan = set(), []
    for parent, token in picks:  # forks first: they copy the parent's tokens before it grows in place
        plan.append((parent if id(parent) not in used else fork_beam(parent, scheduler), token))
        used.add(id(parent))
    for seq, token in plan:
        seq.token_ids.append(token)
        if seq.status == SeqStatus.WAITING and seq not in scheduler.waiting:
            scheduler.add(seq)   # a parked beam: it recomputes its KV, mostly from the prefix cache
    return [seq for seq, _ in plan]


def fork_beam(parent: Sequence, scheduler) -> Sequence:
    request = parent.request
    child = Sequence(request, parent.index, parent.token_ids)
    if parent.status == SeqStatus.RUNNING:
        scheduler.fork_into(parent, child)     # its tables shared, refcounts + 1 (window layers' too)
        scheduler.add_running(child)
    else:
        child.status = SeqStatus.WAITING    # queued by next_beams once it has its token
    return child
