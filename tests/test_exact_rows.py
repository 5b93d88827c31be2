"""A verify step's rows, and a batch's, are computed bit for bit as plain decoding of one sequence computes
them: torch's CPU attention rounds a query differently with the rows beside it and with masked padding, which a
bf16 rounding can turn into another token at a near tie, so the target attends such rows one by one."""
import pytest
import torch

from specserve.engine.model_runner import ForwardItem, ModelRunner
from specserve.layers.attention import paged_attention
from specserve.spec.tree import Tree

L, HKV, G, D, BLOCK = 1, 3, 3, 64, 16


def runner(dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(None, L, HKV, D, 64, BLOCK, dtype, row_by_row=True)


def attend(r: ModelRunner, items: list[ForwardItem], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Attention of the items' new tokens: q [N, Hq, D], kv [N, 2, Hkv, D] their keys and values."""
    _, _, ctx = r.prepare(items)
    return paged_attention(q, kv[:, 0], kv[:, 1], ctx, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                                   [19, 3, 7, 1, 5, 9, 11, 13, 15, 17, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18]])
def test_verify_rows_equal_decode_rows(dtype, table):
    torch.manual_seed(0)
    n_ctx, n_new = 300, 6
    q = torch.randn(n_ctx + n_new, HKV * G, D).to(dtype)
    kv = torch.randn(n_ctx + n_new, 2, HKV, D).to(dtype)
    ids = list(range(n_ctx + n_new))
    decode, verify = runner(dtype), runner(dtype)
    for r in (decode, verify):
        attend(r, [ForwardItem(table, 0, ids[:n_ctx])], q[:n_ctx], kv[:n_ctx])
    one_by_one = torch.cat([attend(decode, [ForwardItem(table, i, ids[i:i + 1])], q[i:i + 1], kv[i:i + 1])
                            for i in range(n_ctx, n_ctx + n_new)])
    at_once = attend(verify, [ForwardItem(table, n_ctx, ids[n_ctx:])], q[n_ctx:], kv[n_ctx:])
    assert torch.equal(one_by_one, at_once)


def test_batch_rows_equal_lone_rows_and_tree_nodes_equal_their_path():
    """Two sequences decoding side by side (one of them verifying a tree) give each row the bits it gets alone;
    a tree node's row equals the chain of its ancestors decoded."""
    torch.manual_seed(1)
    dtype = torch.bfloat16
    lens = (37, 250)
    tables = ([0, 1, 2, 3, 4, 5], [6, 9, 8, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])
    q = [torch.randn(n + 4, HKV * G, D).to(dtype) for n in lens]
    kv = [torch.randn(n + 4, 2, HKV, D).to(dtype) for n in lens]
    tree = Tree([-1, 0, 0, 1])                      # nodes 1 and 2 children of the root, 3 a child of 1
    together, alone = runner(dtype), runner(dtype)
    for r in (together, alone):
        for b, n in enumerate(lens):
            attend(r, [ForwardItem(tables[b], 0, list(range(n)))], q[b][:n], kv[b][:n])
    items = [ForwardItem(tables[0], lens[0], [0]), ForwardItem(tables[1], lens[1], [0] * 4, tree_mask=tree.attn_mask)]
    both = attend(together, items, torch.cat((q[0][lens[0]:lens[0] + 1], q[1][lens[1]:])),
                  torch.cat((kv[0][lens[0]:lens[0] + 1], kv[1][lens[1]:])))
    first = attend(alone, [items[0]], q[0][lens[0]:lens[0] + 1], kv[0][lens[0]:lens[0] + 1])
    assert torch.equal(both[:1], first)
    n = lens[1]
    for node, path in ((0, [0]), (1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])):   # each node decoded after its path
        chain = runner(dtype)
        attend(chain, [ForwardItem(tables[1], 0, list(range(n)))], q[1][:n], kv[1][:n])
        for i, p in enumerate(path):
            row = attend(chain, [ForwardItem(tables[1], n + i, [0])], q[1][n + p:n + p + 1], kv[1][n + p:n + p + 1])
        assert torch.equal(row, both[1 + node:2 + node]), node
