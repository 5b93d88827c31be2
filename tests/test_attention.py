"""Attention over the paged cache: a sequence whose blocks follow each other is read in place, others are
gathered; both give the same hidden states."""
import torch

from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.models.registry import load_model


def test_in_place_and_gathered_context_are_the_same(qwen3_dir):
    model = load_model(qwen3_dir).pack(torch.device("cpu"), torch.float32)
    c = model.config
    ids = torch.randint(0, 400, (15,)).tolist()
    outs = {}
    # [0, 2, 1, 3]: last - first == len - 1 like a run, but not one: must be gathered
    for table, in_place in (([4, 5, 6, 7], True), ([0, 2, 1, 3], False), ([9, 3, 7, 1], False)):
        runner = ModelRunner(model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, 4, torch.float32)
        _, _, ctx = runner.prepare([ForwardItem(table, 0, ids[:10])])
        assert (ctx.calls[0].context_start is not None) == in_place
        if in_place:
            assert ctx.calls[0].context_start == table[0] * 4
        prefill, _ = runner.forward([ForwardItem(table, 0, ids[:10])])
        decode = [runner.forward([ForwardItem(table, i, [ids[i]])])[0] for i in range(10, 15)]
        outs[tuple(table)] = torch.cat([prefill] + decode)
    ref = outs[(4, 5, 6, 7)]
    for table, out in outs.items():
        assert torch.allclose(out, ref, atol=1e-5), table


def test_blocks_are_taken_next_to_the_sequence_when_free():
    from specserve.engine.block_manager import BlockManager
    from specserve.runtime.sequence import Sequence
    from specserve.sampling_params import SamplingParams
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = Sequence(list(range(5)), SamplingParams()), Sequence(list(range(5)), SamplingParams())
    bm.allocate(a)
    bm.ensure(a, 5)
    bm.allocate(b)
    bm.ensure(b, 5)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.ensure(a, 9)                                    # block 2 is b's: the oldest free one instead
    assert a.block_table == [0, 1, 4]
    bm.ensure(a, 13)                                   # next to 4
    assert a.block_table == [0, 1, 4, 5]
    bm.free(b)
    bm.ensure(a, 17)
    assert a.block_table == [0, 1, 4, 5, 6]


def test_a_new_sequence_starts_where_its_prompt_fits_in_one_run():
    from specserve.engine.block_manager import BlockManager
    from specserve.runtime.sequence import Sequence
    from specserve.sampling_params import SamplingParams
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    a, b = Sequence(list(range(4)), SamplingParams()), Sequence(list(range(4)), SamplingParams())
    for s in (a, b):
        bm.allocate(s)
        bm.ensure(s, 4)
    assert a.block_table == [0] and b.block_table == [1]
    bm.free(a)                                         # free: 2..9, then 0; block 1 is b's
    c = Sequence(list(range(10)), SamplingParams())
    bm.allocate(c)
    bm.ensure(c, 10)
    assert c.block_table == [2, 3, 4]
    d = Sequence(list(range(30)), SamplingParams())    # 8 blocks: no free run that long; still allocated
    bm.allocate(d)
    bm.ensure(d, 24)
    assert len(d.block_table) == 6 and len(set(d.block_table)) == 6
