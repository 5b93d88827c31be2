"""Block accounting and scheduling, without a model."""
import pytest

from specserve.engine.block_manager import BlockManager, NoFreeBlocks
from specserve.engine.scheduler import Scheduler
from specserve.runtime.sequence import Sequence, SequenceStatus
from specserve.sampling_params import SamplingParams


def seq_of(tokens):
    return Sequence(list(tokens), SamplingParams())


def test_allocate_ensure_truncate_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq_of(range(10))
    bm.allocate(s)
    assert s.block_table == [] and s.num_computed_tokens == 0
    bm.ensure(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.ensure(s, 17)                                   # room for draft tokens
    assert len(s.block_table) == 5
    bm.truncate(s, 9)                                  # rejected drafts give their blocks back
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    with pytest.raises(NoFreeBlocks):
        bm.ensure(seq_of(range(3)), 40)


def test_prefix_sharing_reference_counts_and_revival():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))
    bm.allocate(a)
    bm.ensure(a, 10)
    a.num_computed_tokens = 10
    bm.register(a, 10, 10)                             # two full blocks hashed, the partial one not
    assert a.num_hashed_blocks == 2
    b = seq_of(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table == a.block_table[:2] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = seq_of([0, 1, 2, 5, 4, 5, 6, 7, 8])            # differs inside the first block: no hit
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    d = seq_of(range(12))                              # freed blocks keep their hash: revived
    bm.allocate(d)
    assert d.num_cached_tokens == 8 and bm.num_free_blocks == 6


def test_blocks_without_the_drafters_kv_are_hit_and_a_drafter_valid_copy_wins_the_hash():
    bm = BlockManager(num_blocks=12, block_size=4)
    a, d = seq_of(range(13)), seq_of(range(13))        # admitted together: two copies of the same blocks
    for s in (a, d):
        bm.allocate(s)
        bm.ensure(s, 13)
    bm.register(a, 12, 4)                              # three blocks hashed, the drafter's K/V in the first only
    assert [bm.blocks[i].drafter_valid for i in a.block_table] == [True, False, False, False]
    b = seq_of(range(13))
    bm.allocate(b)
    assert b.num_cached_tokens == 12 and b.num_drafter_blocks == 1 and b.num_drafter_computed == 4
    assert b.block_table == a.block_table[:3]
    bm.register(d, 12, 12)                             # d's copies hold the drafter's K/V: they win blocks 1-2
    e = seq_of(range(13))
    bm.allocate(e)
    assert e.block_table == a.block_table[:1] + d.block_table[1:3] and e.num_drafter_blocks == 3


def test_prefix_hit_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(8))
    bm.allocate(a)
    bm.ensure(a, 8)
    bm.register(a, 8, 8)
    b = seq_of(range(8))                               # an identical prompt: its last block is recomputed
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_reused_block_loses_its_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq_of(range(4))
    bm.allocate(a)
    bm.ensure(a, 4)
    bm.register(a, 4, 4)
    bm.free(a)
    other = seq_of(range(50, 57))
    bm.allocate(other)
    bm.ensure(other, 8)                                # takes both blocks, the hashed one included
    assert bm.hash_to_block == {}
    assert seq_of(range(6)).num_cached_tokens == 0


def test_scheduler_batches_decodes_and_prompt_chunks():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    long, short = seq_of(range(30)), seq_of(range(5))
    sched.add(long)
    sched.add(short)
    step = sched.schedule(lambda s: 0)
    assert [(x.seq, x.num_new) for x in step] == [(long, 16)]          # the budget cuts the prompt
    long.num_computed_tokens += 16
    step = sched.schedule(lambda s: 0)
    assert [(x.seq, x.num_new) for x in step] == [(long, 14), (short, 2)]
    assert step[0].completes_prompt and not step[1].completes_prompt


def test_scheduler_reserves_draft_slots_and_preempts_newest():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq_of(range(7)), seq_of(range(20, 27))
    for s in (a, b):
        sched.add(s)
    step = sched.schedule(lambda s: 0)
    assert len(step) == 2
    for s in (a, b):                     # both prompts done, one sampled token each
        s.num_computed_tokens = 7
        s.token_ids.append(1)
    # a wants 1 + 6 draft slots: 14 tokens, 4 blocks: b must make room
    step = sched.schedule(lambda s: 6)
    assert [(x.seq, x.num_draft_tokens) for x in step] == [(a, 6)]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b


def test_draft_slots_a_policy_does_not_choose_go_to_prompt_chunks():
    """choose() sets the decoding sequences' lengths before the budget is spent: a sequence held at 0 of its 8
    wanted slots leaves them to a waiting prompt in the same step."""
    for choice in (None, 0, 3):
        bm = BlockManager(num_blocks=32, block_size=4)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
        a, prompt = seq_of(range(7)), seq_of(range(40, 70))
        sched.add(a)
        sched.schedule(lambda s: 0)
        a.num_computed_tokens = 7
        a.token_ids.append(1)
        sched.add(prompt)
        seen = []

        def choose(decoding):
            seen.extend((x.seq, x.num_new, x.num_draft_tokens) for x in decoding)
            for x in decoding:
                x.num_draft_tokens = choice
        step = sched.schedule(lambda s: 8, None if choice is None else choose)
        drafted = 8 if choice is None else choice
        assert [(x.seq, x.num_new, x.num_draft_tokens) for x in step] == [(a, 1, drafted), (prompt, 15 - drafted, 0)]
        assert seen == ([] if choice is None else [(a, 1, 8)])       # asked once, with each sequence's longest


def test_scheduler_drops_draft_slots_before_preempting_itself():
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a = seq_of(range(7))
    sched.add(a)
    sched.schedule(lambda s: 0)
    a.num_computed_tokens = 7
    a.token_ids.append(1)
    step = sched.schedule(lambda s: 4)    # 8 + 4 slots do not fit in 2 blocks; 8 do
    assert [(x.seq, x.num_new, x.num_draft_tokens) for x in step] == [(a, 1, 0)]
