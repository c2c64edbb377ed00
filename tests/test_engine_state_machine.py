"""Random interleavings of add, fork, step, abort, finish, pin and release over the real engine
(model-free runner). After every step: refcounts equal table references, free + used = total, no block both
free and referenced, no write into a shared block, every computed token's KV in the right slot; and when
everything is aborted and released, the pool is all free again."""

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fake_runner import fake_engine
from pagedchat.engine import SamplingParams
from pagedchat.engine.sequence import SeqStatus
from pagedchat.errors import RequestError

EXAMPLES = int(os.environ.get("PAGEDCHAT_FUZZ_EXAMPLES", "100"))
STEPS = int(os.environ.get("PAGEDCHAT_FUZZ_STEPS", "100"))

# A small alphabet and a few shared stems make prefix-cache hits and shared blocks common.
STEMS = [[2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine, self.runner = fake_engine(num_blocks=16, block_size=8, max_num_batched_tokens=16)
        self.request_ids: list[str] = []

    def pinned(self):
        return list(self.engine.scheduler.pins.values())

    def running(self):
        return list(self.engine.scheduler.running)

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(2, 23), max_size=12), n=st.integers(1, 3),
          keep=st.booleans(), max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]),
          seed=st.integers(0, 3))
    def add(self, stem, tail, n, keep, max_tokens, temperature, seed):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, n=n)
        try:
            self.request_ids.append(self.engine.add_request(stem + tail, params, keep=keep))
        except RequestError:
            pass

    @precondition(lambda self: self.engine.scheduler.pins)
    @rule(data=st.data(), suffix=st.lists(st.integers(2, 23), min_size=1, max_size=6))
    def follow_up(self, data, suffix):
        parent = data.draw(st.sampled_from(self.pinned()))
        params = SamplingParams(temperature=0, max_tokens=4)
        try:
            self.request_ids.append(self.engine.add_request(parent.token_ids + suffix, params, keep=True,
                                                            parent=parent))
        except RequestError:
            pass

    @precondition(lambda self: self.engine.scheduler.running or self.engine.scheduler.pins)
    @rule(data=st.data(), keep=st.booleans())
    def fork(self, data, keep):
        handle = data.draw(st.sampled_from(self.running() + self.pinned()))
        if handle.num_tokens + 1 < self.engine.max_model_len:
            self.request_ids.append(self.engine.fork(handle, SamplingParams(temperature=0, max_tokens=3), keep=keep))

    @rule(count=st.integers(1, 4))
    def step(self, count):
        for _ in range(count):
            self.engine.step()

    @precondition(lambda self: self.request_ids)
    @rule(data=st.data())
    def abort(self, data):
        self.engine.abort(data.draw(st.sampled_from(self.request_ids)))

    @precondition(lambda self: self.engine.scheduler.pins)
    @rule(data=st.data())
    def release(self, data):
        self.engine.release(data.draw(st.sampled_from(self.pinned())))

    @invariant()
    def pool_is_consistent(self):
        engine = self.engine
        engine.check_invariants()  # refcounts == table references; free <=> refcount 0; hash table sound
        pool = engine.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        for seq in self.running() + self.pinned():
            self.runner.check_sequence(seq)
        for seq in engine.scheduler.waiting:
            if not seq.block_table:
                assert seq.num_computed == 0

    def teardown(self):
        """After the program: abort and release everything; every block must come back."""
        for rid in self.request_ids:
            self.engine.abort(rid)
        for pin in self.pinned():
            self.engine.release(pin)
        assert not self.engine.scheduler.running and not self.engine.scheduler.pins
        for seq in self.engine.scheduler.waiting:
            assert seq.status != SeqStatus.RUNNING
        self.engine.check_invariants()
        assert self.engine.pool.num_used == 0, "blocks leaked after every request was aborted"


EngineMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                           suppress_health_check=list(HealthCheck))
TestEngineStateMachine = EngineMachine.TestCase
