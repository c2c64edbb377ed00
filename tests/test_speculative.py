"""Speculative decoding keeps outputs exact: greedy tokens equal transformers' and the plain engine's for every
architecture (alone, batched, chunked, preempted, n variants; good drafts and deliberately bad ones), sampled
tokens follow the target distribution (chi-square against the exact Markov-chain marginals), and stops,
max_tokens and EOS cut a verified run where plain decoding would have stopped."""

import random

import pytest
import torch

from fake_runner import EOS, fake_draft, fake_engine
from hf_models import ARCHS
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.sequence import SeqStatus
from pagedchat.engine.decoding.speculative import TAU, DraftBudget, NgramProposer, SpecState
from test_engine_equality import check

NEW_TOKENS = 24


class RandomProposer:
    """A deliberately bad proposer: random tokens, always k of them."""
    can_shadow = False

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, seqs, ks):
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]


class EchoProposer:
    """A proposer that is right as long as the reply repeats `target` (used to force long accepted runs)."""
    can_shadow = False

    def __init__(self, target: list[int]):
        self.target = target

    def propose(self, seqs, ks):
        return [self.target[s.num_output_tokens:s.num_output_tokens + k] for s, k in zip(seqs, ks)]


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram drafts find matches (random models echo them often)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 320) for _ in range(rng.randint(3, 9))]
        out.append([rng.randrange(3, 320) for _ in range(rng.randint(1, 12))] + phrase * rng.randint(2, 5))
    return out


def spec_engine(model_dirs, arch, **kw) -> Engine:
    path, _ = model_dirs[arch]
    return Engine(EngineConfig(model=str(path), **{"num_blocks": 256, "speculate": "ngram", **kw}),
                  show_progress=False)


def check_greedy(engine, hf, batch, n=1, max_tokens=NEW_TOKENS):
    return check(engine, hf, batch, SamplingParams(temperature=0, max_tokens=max_tokens), n=n)


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_greedy_equals_transformers_alone_and_batched(model_dirs, arch):
    engine = spec_engine(model_dirs, arch)
    hf = model_dirs[arch][1]
    check_greedy(engine, hf, repetitive_prompts(1, seed=1))
    check_greedy(engine, hf, repetitive_prompts(6, seed=2))
    stats = engine.speculator.stats
    assert stats.accepted_tokens > 0 and stats.proposed_tokens > stats.accepted_tokens, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_proposer_greedy_equals_transformers(model_dirs, arch):
    """Every draft random: nearly all rejected, rolled back every step; the tokens must not move."""
    engine = spec_engine(model_dirs, arch, num_draft_tokens=5)
    engine.speculator.proposer = RandomProposer(320)
    _pin_depth(engine, 5)  # keep drafting however bad the drafts are
    check_greedy(engine, model_dirs[arch][1], repetitive_prompts(2, seed=3))
    stats = engine.speculator.stats
    assert stats.proposed_tokens > 50 * 2 and stats.accepted_tokens < stats.proposed_tokens


def _pin_depth(engine, k):
    """Drafts of depth k every step, whatever the acceptance or their cost (so bad drafts are really verified)."""
    engine.speculator._depth = lambda seq: min(k, seq.request.params.max_tokens - seq.num_output_tokens - 1)
    engine.speculator.budget = None


def test_ngram_chunked_preempted_and_variants(model_dirs):
    hf = model_dirs["qwen2"][1]
    check_greedy(spec_engine(model_dirs, "qwen2", max_num_batched_tokens=7), hf, repetitive_prompts(2, seed=4))
    engine = spec_engine(model_dirs, "qwen2", num_blocks=10, block_size=8)
    check_greedy(engine, hf, repetitive_prompts(5, seed=5))
    assert engine.scheduler.num_preemptions > 0
    check_greedy(spec_engine(model_dirs, "qwen2"), hf, repetitive_prompts(2, seed=6), n=3)


def test_speculation_matches_plain_engine_token_for_token(model_dirs):
    path, _ = model_dirs["llama"]
    prompts = repetitive_prompts(6, seed=7)
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = Engine(EngineConfig(model=str(path), num_blocks=256), show_progress=False).generate(prompts, params)
    spec = spec_engine(model_dirs, "llama").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


# -- the pool and the finishing rules, on the model-free engine ----------------------------------------------
def greedy_chain(engine, start: int, length: int) -> list[int]:
    """The fake model's greedy continuation of `start` (its logits depend on the last token only)."""
    out, token = [], start
    for _ in range(length):
        token = int(engine.runner.table[token].argmax())
        out.append(token)
    return out


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_and_eos_cut_inside_an_accepted_run(max_tokens):
    engine, runner = fake_engine(speculate="ngram", num_draft_tokens=8)
    prompt = [5, 6, 7]
    expected = greedy_chain(engine, prompt[-1], 40)
    engine.speculator.proposer = EchoProposer(expected)
    _pin_depth(engine, 8)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected[:max_tokens]
    assert engine.pool.num_used == 0
    if EOS in expected[:30]:
        cut = expected.index(EOS) + 1
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
        assert out.outputs[0].token_ids == expected[:min(cut, 40)]


def test_stop_token_cuts_a_run_and_pinned_tail_is_exact():
    engine, runner = fake_engine(speculate="ngram", num_draft_tokens=8)
    prompt = [5, 6, 7]
    expected = greedy_chain(engine, prompt[-1], 30)
    engine.speculator.proposer = EchoProposer(expected)
    _pin_depth(engine, 8)
    stop = expected[5]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop],
                                                    ignore_eos=True), keep=True)
    while not engine.requests[rid].finished:
        engine.step()
    out = engine.pop_output(rid)
    cut = expected.index(stop) + 1
    assert out.outputs[0].token_ids == expected[:cut]
    handle = out.outputs[0].handle.sequence
    assert handle.num_computed == handle.num_tokens - 1
    assert len(handle.block_table) == -(-handle.num_computed // engine.pool.block_size)
    runner.check_sequence(handle)
    engine.check_invariants()
    # a follow-up from the pinned head sees only exact KV
    follow = engine.generate([handle.token_ids + [9]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert follow.outputs[0].token_ids == greedy_chain(engine, 9, 3)


def chi_square_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("top_k", [5])
def test_sampled_distribution_equals_target(top_k):
    """The fake model is a Markov chain over 24 tokens, so the exact distribution of the 4th output token is
    a matrix power; 800 seeded speculative samples (drafts always 4 deep, mostly wrong) must fit it."""
    engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4, num_blocks=512)
    _pin_depth(engine, 4)
    vocab, steps, samples = 24, 4, 800
    engine.speculator.proposer = RandomProposer(vocab, seed=1)
    temperature = 1.3
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=steps, seed=s, ignore_eos=True)
              for s in range(samples)]
    prompt = [3, 4, 5]
    outs = engine.generate([prompt] * samples, params)
    observed = torch.bincount(torch.tensor([o.outputs[0].token_ids[steps - 1] for o in outs]), minlength=vocab)
    # exact marginal of the 4th token
    logits = engine.runner.table / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    transition = logits.softmax(dim=-1).double()
    dist = torch.zeros(vocab, dtype=torch.float64)
    dist[prompt[-1]] = 1.0
    for _ in range(steps):
        dist = dist @ transition
    expected = dist * samples
    keep = expected >= 5  # pool the rare cells, as the test demands
    obs = torch.cat([observed[keep].double(), observed[~keep].double().sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = chi_square_sf(stat, len(exp) - 1)
    assert p > 1e-3, f"chi-square {stat:.1f} on {len(exp) - 1} dof, p = {p:.2g}"
    stats = engine.speculator.stats
    assert stats.accepted_tokens > 0 and stats.proposed_tokens > stats.accepted_tokens


def test_seeded_speculative_sampling_is_reproducible():
    engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4)
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=7, n=3, ignore_eos=True)
    first = [v.token_ids for v in engine.generate([[3, 4, 5, 3, 4, 5]], params)[0].outputs]
    again = [v.token_ids for v in engine.generate([[3, 4, 5, 3, 4, 5]], params)[0].outputs]
    assert first == again and len({tuple(v) for v in first}) > 1


def test_seeded_speculative_sampling_draws_the_plain_tokens():
    """The sampled token of each position comes from the sequence's own noise stream, one draw per emitted
    token, so drafting (however deep, whatever the step budget keeps) does not change a seeded reply."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=11, n=2, ignore_eos=True)
    prompt = [[3, 4, 5, 3, 4, 5, 3]]
    plain, _ = fake_engine()
    expected = [v.token_ids for v in plain.generate(prompt, params)[0].outputs]
    for depth in (1, 4):
        engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4)
        engine.speculator.proposer = EchoProposer(expected[0])  # right for variant 0, mostly wrong for 1
        _pin_depth(engine, depth)
        assert [v.token_ids for v in engine.generate(prompt, params)[0].outputs] == expected
        stats = engine.speculator.stats
        assert 0 < stats.accepted_tokens < stats.proposed_tokens


def test_draft_budget_threshold_is_what_a_draft_costs_in_tokens():
    """seconds = sequences * token + drafts * draft: a draft is worth asking for while its chance of being
    accepted is at least draft / token (never below TAU); a class is measured apart from the others."""
    budget = DraftBudget()
    assert budget.wants_plain(16) and budget.threshold(16) == TAU  # nothing measured: drafts count as cheap
    budget.observe(16, 0, 16 * 1.0)
    assert not budget.wants_plain(16) and budget.threshold(16) == TAU  # no drafted step yet
    for step in range(50):
        drafts = step % 4 * 8
        budget.observe(16, drafts, 16 * 1.0 + drafts * 0.4)  # a draft costs 0.4 of a token at batch 16
    assert budget.threshold(16) == pytest.approx(0.4)
    for step in range(300):  # the drafts got cheap (say, the batch's contexts changed): the threshold follows
        drafts = step % 4 * 8
        budget.observe(16, drafts, 16 * 1.0 + drafts * 0.02)
    assert budget.threshold(16) == TAU
    assert budget.wants_plain(1) and budget.threshold(1) == TAU


def test_draft_budget_runs_a_plain_step_when_the_plain_cost_is_stale():
    budget = DraftBudget()
    plain = []
    for step in range(400):
        wants = budget.wants_plain(4)
        plain.append(step) if wants else None
        budget.observe(4, 0 if wants else 12, 4.0 + (0 if wants else 12 * 0.1))
    gaps = [b - a for a, b in zip(plain, plain[1:])]
    assert plain[0] == 0 and 60 < min(gaps) and max(gaps) < 150  # one plain step every ~110 steps


def test_budget_keeps_a_single_sequence_drafting_through_misses():
    """Drafts at batch 1 pay in bursts (a regenerated reply re-aligns with its sibling now and then): the
    budget judges what a draft costs, not the tokens of the last few steps, so a run of misses lowers the
    sequence's own depth but never switches drafting off for good."""
    engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4)
    spec = engine.speculator
    spec.proposer = RandomProposer(24)  # always k drafts, all missed
    rid = engine.add_request([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(temperature=0, max_tokens=200))
    seq = engine.requests[rid].sequences[0]
    while seq.num_output_tokens == 0:
        engine.step()
    seq.spec = SpecState(seq)
    depths = []
    for step in range(200):  # what a step costs: 1 + 0.05 per draft (cheap); every draft missed
        spec.propose(engine.scheduler.running)
        depths.append(len(seq.draft_ids))
        spec.record(seq, len(seq.draft_ids), 0, 1)
        spec.budget.observe(1, len(seq.draft_ids), 1.0 + 0.05 * len(seq.draft_ids))
    assert depths[:2] == [0, 4] and depths[-1] == 0  # a plain step to measure first; the misses: depth 0
    assert spec.budget.threshold(1) == TAU
    seq.spec.alpha = 0.5  # the reply re-aligned (its shadow guesses hit again)
    spec.budget.observe(1, 0, 1.0)  # not a step that runs plain to measure it
    spec.propose(engine.scheduler.running)
    assert len(seq.draft_ids) == seq.spec.depth(4) == 3  # 0.5, 0.25, 0.125 >= TAU


class _PlainBudget:
    """A draft budget running every step plain (nothing proposes)."""
    wants_plain = staticmethod(lambda decodes: True)
    threshold = staticmethod(lambda decodes: 1.0)
    observe = staticmethod(lambda *args: None)


def test_draft_restarts_after_its_blocks_were_released_while_nothing_proposed():
    """A sequence preempted during plain steps (the budget's: nothing proposes, so no shadow is synced or
    dropped), readmitted and decoding again before anything proposes: its draft's shadow outlived the release
    of its blocks and must recompute from 0, not trust positions whose blocks may now be other ones."""
    engine, runner = fake_engine(num_blocks=12, block_size=8)
    draft = fake_draft(engine, runner, num_draft_tokens=3, disagree=0.0)
    engine.speculator.budget = None
    rid = engine.add_request([2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seq = engine.requests[rid].sequences[0]
    while seq.num_output_tokens < 8:
        engine.step()
    shadow = draft.proposer.shadows[seq.seq_id]
    assert shadow.seq.num_computed > 8
    engine.speculator.budget = _PlainBudget()
    engine.scheduler._preempt(seq)
    while seq.status != SeqStatus.RUNNING or seq.num_computed < seq.num_tokens - 1:
        engine.step()
    assert draft.proposer.shadows[seq.seq_id] is shadow and shadow.resets != seq.kv_resets
    engine.speculator.budget = None
    run, starts = draft.run, []
    draft.run = lambda batch: (starts.append(batch.items[0][0].num_computed), run(batch))[1]
    for _ in engine.steps([rid]):
        engine.check_invariants()
        draft.check_shadows()
    assert starts[0] == 0, f"the draft went on from position {starts[0]} of blocks released since"
    assert engine.speculator.stats.accepted_tokens > 0


def test_closed_batch_drafts_only_for_the_sequences_furthest_from_done():
    """Nothing waits: a sequence more than one step's drafts ahead of the one with the most tokens left
    decodes plainly (its drafts would not end the run sooner)."""
    engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4)
    spec = engine.speculator
    spec.budget.wants_plain = lambda decodes: False  # drafts count as cheap (nothing measured)
    spec.proposer = RandomProposer(24)  # always k drafts: only the closed-batch rule withholds them
    seqs = []
    for out_len in (0, 3, 9):
        rid = engine.add_request([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(temperature=0, max_tokens=20))
        seqs.append(engine.requests[rid].sequences[0])
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    for seq, extra in zip(seqs, (0, 3, 9)):  # put them at different distances from max_tokens
        seq.token_ids += [4] * extra
        seq.num_computed = seq.num_tokens - 1
    spec.propose(engine.scheduler.running, closed=True)
    ahead = [bool(s.draft_ids) for s in seqs]
    assert ahead[0] and ahead[1] and not ahead[2], ahead
    spec.propose(engine.scheduler.running, closed=False)
    assert all(s.draft_ids for s in seqs)


def test_closed_batch_of_equal_sequences_drafts_only_if_all_may_accept():
    """Nothing waits and several sequences have the most tokens left: a drafted step shortens the run only if
    every one of them accepts, so drafts wait until that chance (their acceptance estimates multiplied) is
    worth it; a single furthest sequence keeps its own depth rule, and an open batch drafts as the budget says."""
    engine, _ = fake_engine(speculate="ngram", num_draft_tokens=4)
    spec = engine.speculator
    spec.budget.wants_plain = lambda decodes: False  # drafts count as cheap (nothing measured)
    spec.proposer = RandomProposer(24)
    seqs = []
    for _ in range(3):
        rid = engine.add_request([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(temperature=0, max_tokens=20))
        seqs.append(engine.requests[rid].sequences[0])
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    for alpha, drafts in ((0.3, False), (0.9, True)):  # 0.3 ** 3 < TAU <= 0.9 ** 3
        for seq in seqs:
            seq.spec = seq.spec or SpecState(seq)
            seq.spec.alpha = alpha
        spec.propose(engine.scheduler.running, closed=True)
        assert all(bool(s.draft_ids) == drafts for s in seqs), alpha
    seqs[0].spec.alpha = seqs[1].spec.alpha = 0.3
    spec.propose(engine.scheduler.running, closed=False)
    assert all(s.draft_ids for s in seqs)
    seqs[0].token_ids.pop()  # one sequence furthest from done: alone, its own depth (alpha 0.3: one draft)
    seqs[0].num_computed -= 1
    spec.propose(engine.scheduler.running, closed=True)
    assert len(seqs[0].draft_ids) == 1


# -- the n-gram proposer -------------------------------------------------------------------------------------
class _Seq:
    def __init__(self, tokens, context=()):
        from types import SimpleNamespace

        self.token_ids = list(tokens)
        self.request = SimpleNamespace(context=[list(c) for c in context])
        self.spec = SpecState(self)


def test_ngram_prefers_longest_then_the_stream_matching_furthest_back():
    proposer = NgramProposer()
    # own stream: "1 2 3" was followed by 4 5 6
    assert proposer.propose([_Seq([1, 2, 3, 4, 5, 6, 9, 1, 2, 3])], [3]) == [[4, 5, 6]]
    # a longer (4-gram) match beats a more recent 1-gram
    assert proposer.propose([_Seq([7, 8, 9, 3, 5, 1, 7, 8, 9, 3])], [2]) == [[5, 1]]
    # a sibling reply whose context matches further back wins over the sequence's own shorter echo
    seq = _Seq([1, 22, 23, 10, 11, 99, 7, 20, 21, 22, 23, 10, 11], context=[[20, 21, 22, 23, 10, 11, 12, 13, 14]])
    assert proposer.propose([seq], [3]) == [[12, 13, 14]]
    seq = _Seq([1, 22, 23, 10, 11, 99, 7, 20, 21, 22, 23, 10, 11], context=[[0, 22, 23, 10, 11, 12, 13, 14]])
    assert proposer.propose([seq], [3]) == [[99, 7, 20]]  # a tie: the sequence's own stream
    seq = _Seq([50, 51, 52, 53, 54], context=[[1, 50, 51, 52, 53, 54, 60, 61]])
    assert proposer.propose([seq], [4]) == [[60, 61]]
    assert proposer.propose([_Seq([1, 2, 3])], [3]) == [[]]
    # a loop in the sequence's own tokens continues with its period (an overlapping copy)
    assert proposer.propose([_Seq([9, 4, 5, 6, 4, 5, 6, 4])], [5]) == [[5, 6, 4, 5, 6]]
    assert proposer.propose([_Seq([1, 7, 7, 7])], [3]) == [[7, 7, 7]]
    # chained: a copy that reaches the end of the sibling goes on where its drafts occur again
    assert proposer.propose([_Seq([3, 4, 5, 6, 0, 8], context=[[8, 3, 4]])], [4]) == [[3, 4, 5, 6]]


def test_ngram_index_grows_with_the_sequence():
    proposer = NgramProposer()
    seq = _Seq([1, 2, 3, 1])
    assert proposer.propose([seq], [2]) == [[2, 3]]
    seq.token_ids += [2, 3, 8, 1, 2, 3]
    assert proposer.propose([seq], [2]) == [[8, 1]]


# -- the command line ----------------------------------------------------------------------------------------
def test_run_json_spec_report_and_same_tokens_as_off(pagedchat_cli, model_dirs):
    import json

    path, _ = model_dirs["mistral"]
    prompt = "a b c d e f g a b c d e f g a b c d e f g"
    reports = {}
    for method in ("off", "ngram"):
        code, out, err = pagedchat_cli("run", "-m", str(path), "--raw", "--temperature", "0", "--json",
                                       "--max-tokens", "30", "--speculate", method, "--num-draft-tokens", "4", prompt)
        assert code == 0, err
        reports[method] = json.loads(out)
    assert "spec" not in reports["off"]
    spec = reports["ngram"]["spec"]
    assert set(spec) == {"method", "proposed_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_step"}
    assert spec["method"] == "ngram" and spec["tokens_per_step"] >= 1.0
    assert reports["ngram"]["outputs"][0]["token_ids"] == reports["off"]["outputs"][0]["token_ids"]


@pytest.mark.parametrize("args, message", [
    (["--speculate", "sometimes"], "--speculate must be ngram, draft or off"),
    (["--speculate", "draft"], "--speculate draft needs a draft model"),
    (["--speculate", "ngram", "--num-draft-tokens", "0"], "--num-draft-tokens must be from 1 to 32"),
])
def test_bad_speculation_flags_are_one_line_errors(pagedchat_cli, model, args, message):
    code, out, err = pagedchat_cli("run", "-m", str(model), "--raw", *args, "hello")
    assert code != 0 and message in err and "Traceback" not in err


# -- the draft model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_draft(tmp_path_factory, model_dirs):
    """A deliberately bad draft: a 1-layer random llama with another seed, same tokenizer as the targets."""
    import shutil

    from hf_models import build_model

    path = tmp_path_factory.mktemp("draft") / "bad"
    build_model("llama", path, seed=7, with_tokenizer=False, num_hidden_layers=1)
    for f in model_dirs["llama"][0].iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    return path


def draft_engine(model_dirs, arch, draft, **kw) -> Engine:
    path, _ = model_dirs[arch]
    return Engine(EngineConfig(model=str(path), **{"num_blocks": 256, "draft_model": str(draft), **kw}),
                  show_progress=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_greedy_equals_transformers(model_dirs, arch, bad_draft):
    hf = model_dirs[arch][1]
    # the target as its own draft: nearly every draft is right, long accepted runs
    engine = draft_engine(model_dirs, arch, model_dirs[arch][0])
    assert engine.speculator.stats.method == "draft"
    check_greedy(engine, hf, repetitive_prompts(3, seed=8))
    stats = engine.speculator.stats
    assert stats.accepted_tokens >= 0.98 * stats.proposed_tokens > 0, stats  # the draft's KV is right
    # a bad draft, drafting every step: nearly all rejected, and the tokens do not move
    engine = draft_engine(model_dirs, arch, bad_draft, num_draft_tokens=4)
    _pin_depth(engine, 4)
    check_greedy(engine, hf, repetitive_prompts(3, seed=9))
    engine.check_invariants()
    stats = engine.speculator.stats
    assert stats.proposed_tokens > stats.accepted_tokens


def test_draft_model_preempted_and_variants(model_dirs):
    hf = model_dirs["qwen3"][1]
    engine = draft_engine(model_dirs, "qwen3", model_dirs["qwen3"][0], num_blocks=10, block_size=8)
    check_greedy(engine, hf, repetitive_prompts(5, seed=10))
    assert engine.scheduler.num_preemptions > 0
    check_greedy(draft_engine(model_dirs, "qwen3", model_dirs["qwen3"][0]), hf, repetitive_prompts(2, seed=11), n=3)


def _record_proposals(engine) -> list[tuple[list[int], list[int]]]:
    """Every (tokens, drafts) the engine's draft proposer returns from now on."""
    proposer, log = engine.speculator.proposer, []
    propose = proposer.propose

    def record(seqs, ks):
        drafts = propose(seqs, ks)
        log.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts) if d)
        return drafts

    proposer.propose = record
    return log


def _check_proposals_equal_plain_draft(draft_path, log):
    """Each recorded proposal is what the draft model alone, greedy in a pool of its own, continues with."""
    assert len(log) > 10, log
    plain = Engine(EngineConfig(model=str(draft_path), num_blocks=256), show_progress=False)
    outs = plain.generate([tokens for tokens, _ in log],
                          [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in log])
    for (tokens, drafts), out in zip(log, outs):
        assert out.outputs[0].token_ids == drafts, f"after {len(tokens)} tokens the draft proposed {drafts}"


def test_draft_kv_lives_in_the_target_pool(model_dirs, bad_draft):
    """One allocator: the draft's caches have a slot per block of the engine's pool and no pool of their own;
    every slot the draft writes lies in a block of its target's live table, private unless full; and its
    proposals equal the draft model's own greedy run on the same tokens (its KV is right, not only
    harmless), also after preemption and prefix-cache hits."""
    from pagedchat.engine.kv.block_pool import BlockPool

    engine = draft_engine(model_dirs, "llama", bad_draft, num_draft_tokens=4, num_blocks=14, block_size=8)
    proposer = engine.speculator.proposer
    assert not any(isinstance(v, BlockPool) for obj in (proposer, proposer.runner) for v in vars(obj).values())
    assert proposer.runner.num_blocks == engine.pool.num_blocks and engine.runner.block_sharers == [proposer.runner]
    _pin_depth(engine, 4)
    run, bs, written = proposer.runner.run, engine.pool.block_size, []

    def checked_run(batch):
        targets = {id(s.seq): s.target for s in proposer.shadows.values()}
        for shadow, n in batch.items:
            target = targets[id(shadow)]
            assert shadow.block_table is target.block_table
            for p in range(shadow.num_computed, shadow.num_computed + n):
                block = target.block_table[p // bs]
                assert engine.pool.ref_count[block] == 1 or p // bs < target.num_computed // bs, block
                written.append(block)
        return run(batch)

    proposer.runner.run = checked_run
    log = _record_proposals(engine)
    prompts = repetitive_prompts(4, seed=12)
    hf = model_dirs["llama"][1]
    check_greedy(engine, hf, prompts)                    # a small pool: preemptions
    assert engine.scheduler.num_preemptions > 0 and written
    check_greedy(engine, hf, prompts[:2])                # the same prompts again: prefix-cache hits
    assert engine.pool.prefix_hit_tokens > 0
    engine.check_invariants()
    assert engine.pool.num_used == 0
    _check_proposals_equal_plain_draft(bad_draft, log)


def test_draft_kv_of_forked_variants_is_their_own(model_dirs, bad_draft):
    """n = 3 sampled variants share the prompt's blocks, its partial last block included: each copies it
    before its draft writes, so each sibling's proposals equal a solo draft run on its own tokens."""
    engine = draft_engine(model_dirs, "qwen3", bad_draft, num_draft_tokens=3, block_size=8)
    _pin_depth(engine, 3)
    log = _record_proposals(engine)
    prompt = repetitive_prompts(1, seed=13)[0]
    assert len(prompt) % 8, "the prompt must end in a partial block"
    out = engine.generate([prompt], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12))[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3, "the variants did not diverge"
    assert engine.pool.cow_copies >= 2
    _check_proposals_equal_plain_draft(bad_draft, log)


def test_draft_kv_survives_copy_on_write_of_a_forked_block(model_dirs, bad_draft):
    """Engine.fork of a sequence that is drafting: parent and child share its partial last block, and the
    first to draft copies it. The copy must carry the draft's KV with the target's (the runner copies the
    draft's caches too), or the one that keeps drafting from its computed KV proposes from garbage."""
    engine = draft_engine(model_dirs, "llama", bad_draft, num_draft_tokens=3, block_size=8)
    _pin_depth(engine, 3)
    log = _record_proposals(engine)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rid = engine.add_request(repetitive_prompts(1, seed=14)[0], greedy)
    parent = engine.requests[rid].sequences[0]
    while parent.num_output_tokens < 6 or parent.num_computed % 8 == 0:
        engine.step()
    shadow = engine.speculator.proposer.shadows[parent.seq_id]
    assert shadow.seq.num_computed > parent.num_computed - 8, "the parent's draft KV should be in its last block"
    child = engine.fork(parent, greedy)
    cows = engine.pool.cow_copies
    for _ in engine.steps([rid, child]):
        pass
    assert engine.pool.cow_copies > cows
    _check_proposals_equal_plain_draft(bad_draft, log)


def test_draft_model_on_a_sliding_window_target(model_dirs, bad_draft):
    """Gemma 3 releases blocks behind its window in its window groups' tables; the draft reads the global
    group's table (block_table), which keeps every block. A sliding-window draft (the target itself) keeps no
    window tables: its window layers read the same table and apply the window in attention. Greedy tokens
    stay transformers' for 40 tokens past a 24-token window, alone, batched and preempted."""
    hf = model_dirs["gemma3"][1]
    prompts = repetitive_prompts(3, seed=15)
    engine = draft_engine(model_dirs, "gemma3", model_dirs["gemma3"][0])
    check_greedy(engine, hf, prompts, max_tokens=40)
    stats = engine.speculator.stats
    assert stats.accepted_tokens >= 0.98 * stats.proposed_tokens > 0, stats
    engine = draft_engine(model_dirs, "gemma3", bad_draft, num_draft_tokens=4, num_blocks=40, block_size=8)
    _pin_depth(engine, 4)
    check_greedy(engine, hf, prompts, max_tokens=40)
    assert engine.scheduler.num_preemptions > 0


def test_draft_with_another_tokenizer_is_refused(pagedchat_cli, model, tmp_path):
    from hf_models import build_model

    other = tmp_path / "other"
    build_model("llama", other, with_tokenizer=False, vocab_size=100)
    code, out, err = pagedchat_cli("run", "-m", str(model), "--raw", "--draft-model", str(other), "hello")
    assert code != 0 and "Traceback" not in err
    assert "tokenizer" in err and str(other) in err


def test_bench_spec_smoke():
    import json

    from typer.testing import CliRunner

    from pagedchat.cli import app

    result = CliRunner().invoke(app, ["bench", "spec", "--random", "llama", "--random-size", "tiny", "--batch", "2",
                                      "--max-tokens", "8", "--repeats", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    r = json.loads(result.stdout)
    assert [(row["workload"], row["batch"]) for row in r["rows"]] == [
        (w, b) for b in (1, 2) for w in ("edit", "regen", "plain")]
    for row in r["rows"]:
        assert row["off_tok_s"] > 0 and row["spec_tok_s"] > 0 and 0 <= row["acceptance_rate"] <= 1
        assert row["off_cpu_tok_s"] > 0 and row["cpu_speedup"] == row["spec_cpu_tok_s"] / row["off_cpu_tok_s"]
        assert row["greedy_identical"] is (None if row["workload"] == "regen" else True), row
    from pagedchat.bench import gpu

    figures = gpu.read_spec(result.stdout, None)   # what the GPU check reads of the same run
    assert set(figures["speedup_batch1"]) == {"edit", "regen", "plain"} and figures["greedy_identical"] is True
