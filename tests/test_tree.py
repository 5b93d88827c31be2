import pytest
import torch

from specserve.layers.sampler import sample_from_probs
from specserve.drafting.tree import Tree, accept_tree, path_moves

from stats import assert_samples_from

V = 8
N = 50_000


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in index order, the root's under -1."""
    kids: dict[int, list[int]] = {j: [] for j in range(-1, len(parents))}
    for j, parent in enumerate(parents):
        kids[parent].append(j)
    return kids


def reference_walk(y: list[int], tree: Tree, tokens: list[int]) -> tuple[list[int], int]:
    """The rule, literally: from the root, move to the first child carrying the token drawn here."""
    kids_of = children_of(tree.parents)
    path, kids, row = [], kids_of[-1], 0
    while True:
        nxt = next((c for c in kids if tokens[c] == y[row]), None)
        if nxt is None:
            return path, y[row]
        path.append(nxt)
        kids, row = kids_of[nxt], nxt + 1


def walk(y: torch.Tensor, tree: Tree, tokens: torch.Tensor) -> tuple[list[int], int]:
    """accept_tree on one row: (accepted node indices from the root down, the final token)."""
    accepted, final = accept_tree(y[None], tree, tokens[None])
    return accepted[0].nonzero().squeeze(1).tolist(), int(final[0])


#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_structure_of_a_hand_built_tree():
    tree = Tree(PARENTS)
    assert tree.num_nodes == 6
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.parent_rows.tolist() == [0, 0, 1, 1, 2, 3]
    assert tree.attn_mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree.earlier_sibling.nonzero().tolist() == [[1, 0], [3, 2]]


def test_the_target_forward_of_a_tree():
    tree = Tree(PARENTS)
    assert tree.positions(10) == [10, 11, 11, 12, 12, 12, 13]
    mask = tree.forward_mask()
    assert mask.shape == (7, 7) and mask[:, 0].all() and not mask[0, 1:].any()
    assert torch.equal(mask[1:, 1:], tree.attn_mask)


def test_chains_need_no_tree():
    assert Tree.of(None) is None and Tree.of([]) is None and Tree.of([-1, 0, 1]) is None
    assert Tree.of([-1, -1]).parents == [-1, -1]
    assert torch.equal(Tree([-1, 0, 1]).attn_mask, torch.ones(3, 3, dtype=torch.bool).tril())
    empty = Tree([])
    assert empty.num_nodes == 0 and walk(torch.tensor([4]), empty, torch.empty(0, dtype=torch.long)) == ([], 4)


def test_path_moves_compact_the_accepted_path():
    assert path_moves(20, [0, 2, 5]) == ([20, 22, 25], [20, 21, 22])
    assert path_moves(20, [0, 1]) is None and path_moves(20, []) is None
    assert path_moves(7, [1]) == ([8], [7])


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2], [-1, 0, 3]])
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError):
        Tree(parents)


def test_accept_tree_hand_cases():
    tree = Tree(PARENTS)
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    # rows of the argmax: root, after node 0, ..., after node 5
    cases = [
        ([10, 12, 9, 15, 9, 9, 7], ([0, 2, 5], 7)),  # down to the deepest leaf, then the bonus token
        ([10, 13, 9, 9, 9, 9, 9], ([0, 3], 9)),      # second child of node 0, leaf: bonus from node 3's row
        ([11, 9, 14, 9, 9, 8, 9], ([1, 4], 8)),
        ([10, 99, 9, 9, 9, 9, 9], ([0], 99)),        # stops in the middle with the target's own token
        ([42, 12, 9, 9, 9, 9, 9], ([], 42)),         # nothing accepted
    ]
    for argmax, want in cases:
        assert walk(torch.tensor(argmax), tree, tokens) == want


def test_duplicate_sibling_tokens_enter_the_first_only():
    tree = Tree([-1, -1, 1])
    tokens = torch.tensor([5, 5, 6])
    assert walk(torch.tensor([5, 6, 6, 1]), tree, tokens) == ([0], 6)


def test_accept_tree_is_the_walk_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        parents = [int(torch.randint(-1, j, (1,), generator=gen)) if j else -1 for j in range(n)]
        tree = Tree(parents)
        B = 40
        tokens = torch.randint(0, 3, (B, n), generator=gen)  # a small vocabulary: long walks, duplicate siblings
        y = torch.randint(0, 3, (B, n + 1), generator=gen)
        accepted, final = accept_tree(y, tree, tokens)
        for b in range(B):
            path, last = reference_walk(y[b].tolist(), tree, tokens[b].tolist())
            assert accepted[b].nonzero().squeeze(1).tolist() == path and int(final[b]) == last


def test_sampled_rows_walk_the_tree():
    gen = torch.Generator().manual_seed(1)
    tree = Tree(PARENTS)
    for _ in range(50):
        p = torch.softmax(torch.randn(7, 4, generator=gen) * 2, dim=-1)
        tokens = torch.randint(0, 4, (6,), generator=gen)
        u = torch.rand(7, generator=gen, dtype=torch.float64)
        y = sample_from_probs(p, u)
        assert walk(y, tree, tokens) == reference_walk(y.tolist(), tree, tokens.tolist())
        # one-hot rows (greedy) draw the argmax
        argmax = p.argmax(-1)
        one_hot = torch.nn.functional.one_hot(argmax, 4).float()
        assert walk(sample_from_probs(one_hot, u), tree, tokens) == walk(argmax, tree, tokens)


def test_emitted_tokens_follow_the_target():
    """First token ~ p(root); the token after a root child c ~ p(c); after the path 0 -> 2, ~ p(node 2)."""
    gen = torch.Generator().manual_seed(2)
    tree = Tree(PARENTS)
    n = tree.num_nodes
    tokens = torch.tensor([1, 4, 1, 6, 2, 3])
    p = torch.softmax(torch.randn(n + 1, V, generator=gen), dim=-1)
    p[0, [1, 4]] += 0.3  # make the root's children likely so that the conditional tests have data
    p[1, 1] += 0.3
    p = p / p.sum(-1, keepdim=True)
    y = sample_from_probs(p.repeat(N, 1), torch.rand(N * (n + 1), generator=gen, dtype=torch.float64)).view(N, n + 1)
    accepted, final = accept_tree(y, tree, tokens.expand(N, n))
    # the emitted sequence is tokens[path] + [final]
    num = accepted.sum(1)
    nodes = torch.where(accepted, torch.arange(n), n).sort(dim=1).values  # path node indices first, padded with n
    emitted = torch.cat([tokens, torch.tensor([-1])])[nodes]               # [N, n]
    emitted = emitted.scatter(1, num[:, None], final[:, None])
    assert_samples_from(emitted[:, 0], p[0])
    for node in children_of(PARENTS)[-1]:
        rows = emitted[:, 0] == tokens[node]
        assert rows.sum() > 5_000
        assert_samples_from(emitted[rows, 1], p[node + 1])
    rows = (emitted[:, 0] == tokens[0]) & (emitted[:, 1] == tokens[2])
    assert rows.sum() > 2_000
    assert_samples_from(emitted[rows, 2], p[2 + 1])
