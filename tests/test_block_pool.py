"""BlockPool alone under random allocate / fork / append / free / preempt programs."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedchat.engine.kv.block_pool import BlockPool, OutOfBlocks

BS = 4


class PoolMachine(RuleBasedStateMachine):
    """Tables are lists of block ids; `written` models block contents to catch writes into shared blocks."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=BS)
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    @rule(tokens=st.integers(1, 9))
    def allocate(self, tokens):
        table = []
        try:
            for _ in range(-(-tokens // BS)):
                table.append(self.pool.allocate())
        except OutOfBlocks:
            self.pool.free_table(table)
            return
        self.tables.append(table)
        self.lengths.append(tokens)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.append(self.pool.fork_table(self.tables[i]))
        self.lengths.append(self.lengths[i])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def append(self, data):
        """Write one token: copy-on-write the last block if shared, or take a new block when it is full."""
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table, length = self.tables[i], self.lengths[i]
        try:
            if length % BS == 0:
                table.append(self.pool.allocate())
            else:
                self.pool.copy_on_write(table, len(table) - 1)
        except OutOfBlocks:
            return
        assert self.pool.ref_count[table[-1]] == 1, "about to write into a shared block"
        self.lengths[i] += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.pool.free_table(self.tables.pop(i))
        self.lengths.pop(i)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def preempt_newest(self, data):
        self.pool.free_table(self.tables.pop())
        self.lengths.pop()

    @invariant()
    def refcounts_match_tables(self):
        self.pool.check_invariants(self.tables)
        used = {b for t in self.tables for b in t}
        assert self.pool.num_used == len(used)
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks

    def teardown(self):
        for table in self.tables:
            self.pool.free_table(table)
        assert self.pool.num_free == self.pool.num_blocks, "leaked blocks"


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_freed_prefix_is_reused_lru_and_evicted_last():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    h = pool.register(a, None, (1, 2))
    pool.register(b, h, (3, 4))
    pool.free_table([a, b])
    assert pool.stats().cached == 2
    assert pool.lookup(None, (1, 2)) == (a, h)
    # unhashed free blocks are handed out before cached ones
    c, d = pool.allocate(), pool.allocate()
    assert {c, d}.isdisjoint({a, b})
    # then the tail of the freed prefix goes before its head
    assert pool.allocate() == b
    assert pool.lookup(None, (1, 2)) == (a, h)


def test_writing_into_an_owned_hashed_block_drops_it_from_the_index():
    """A fork from an earlier point of a branch shares that branch's full block; once the branch's pin is
    dropped the fork owns it alone and writes into it in place: it must no longer be a prefix-cache hit."""
    pool = BlockPool(num_blocks=4, block_size=2)
    table = [pool.allocate()]
    pool.register(table[0], None, (1, 2))
    assert pool.copy_on_write(table, 0) is None and pool.ref_count[table[0]] == 1
    assert pool.lookup(None, (1, 2)) is None
    pool.check_invariants([table])


def test_a_table_gets_the_next_block_when_it_is_free_and_caches_nothing():
    """allocate(after=b) keeps a sequence's blocks consecutive (the CPU decode attention then reads a batch-1
    context in place), but never at the cost of a cached block: that one keeps its place in the LRU order."""
    pool = BlockPool(num_blocks=6, block_size=2)
    first = pool.allocate()
    other = pool.allocate()                       # another sequence took first + 1
    assert other == first + 1
    third = pool.allocate(after=first)            # the successor is taken: the oldest free block instead
    assert third not in (first, other)
    assert pool.allocate(after=third) == third + 1
    cached = third + 2
    pool.incref(cached)
    pool.register(cached, None, (7, 8))
    pool.decref(cached)                           # free, but holding a cached prefix
    nxt = pool.allocate(after=third + 1)
    assert nxt != cached and pool.lookup(None, (7, 8)) == (cached, pool.block_hash[cached])
    pool.check_invariants([[first], [other], [third, third + 1], [nxt]])
