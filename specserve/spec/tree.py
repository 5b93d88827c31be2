"""Token trees for tree drafting (EAGLE3), and their exact verification.

A tree is built once from a parent array; everything the engine needs per step (depths for
positions, the attention mask, root-to-leaf paths) is derived at construction, never per call.
"""
from dataclasses import dataclass, field

import torch

from specserve.layers.sampler import sample_from_probs


@dataclass(slots=True)
class Tree:
    """A tree of n draft nodes under the root (the last committed token).

    parents[j] is node j's parent, -1 for a child of the root, and parents[j] < j: ancestors come
    before their descendants, so index order is a valid order to feed the nodes to the target.
    Siblings should carry distinct tokens (the drafter's top-k guarantees it); if two do not, only
    the first can ever be accepted, which costs acceptance but never exactness.
    """
    parents: list[int]
    device: torch.device | str = "cpu"
    num_nodes: int = field(init=False)
    depth: torch.Tensor = field(init=False)            # [n] int64, 1 for the root's children
    attn_mask: torch.Tensor = field(init=False)        # [n, n] bool: i sees j iff j is i or an ancestor
    root_children: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)      # children[j]: node j's children, in index order
    leaf_paths: list[list[int]] = field(init=False)    # root-to-leaf node indices, one list per leaf
    parent_rows: torch.Tensor = field(init=False)      # [n] int64, parents + 1: node j's row in p and y
    earlier_sibling: torch.Tensor = field(init=False)  # [n, n] bool: k is a sibling of j and k < j

    def __post_init__(self):
        n = self.num_nodes = len(self.parents)
        for j, parent in enumerate(self.parents):
            if not -1 <= parent < j:
                raise ValueError(f"parents[{j}] = {parent}: a parent must be -1 or an earlier node")
        self.root_children = [j for j, parent in enumerate(self.parents) if parent == -1]
        self.children = [[] for _ in range(n)]
        depth = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        for j, parent in enumerate(self.parents):
            if parent >= 0:
                self.children[parent].append(j)
                mask[j] |= mask[parent]
            depth[j] = 1 if parent < 0 else depth[parent] + 1
        self.leaf_paths = [mask[j].nonzero().squeeze(1).tolist() for j in range(n) if not self.children[j]]
        parents = torch.tensor(self.parents, dtype=torch.long).reshape(n)
        self.depth = torch.tensor(depth, dtype=torch.long).reshape(n).to(self.device)
        self.attn_mask = mask.to(self.device)
        self.parent_rows = (parents + 1).to(self.device)
        index = torch.arange(n)
        earlier_sibling = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
        self.earlier_sibling = earlier_sibling.to(self.device)

    @classmethod
    def chain(cls, k: int, device: torch.device | str = "cpu") -> "Tree":
        return cls(list(range(-1, k - 1)), device)

    @property
    def max_depth(self) -> int:
        return max((len(path) for path in self.leaf_paths), default=0)


def accept_tree(
    y: torch.Tensor,       # [B, n+1] int64: the target's draw at the root (col 0) and after node j (col j+1)
    tree: Tree,
    tokens: torch.Tensor,  # [B, n] int64: the draft token of each node
) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk "start at the root; while the token the target drew here is a child's token, move to
    that child", done for every node at once: a node is accepted iff it and all of its ancestors
    carry the token the target drew at their parent.

    Returns (accepted [B, n] bool, a root-to-node chain; final [B] int64, the token drawn at its end).
    """
    B, n = tokens.shape
    drawn = y.gather(1, tree.parent_rows.expand(B, n))                               # [B, n]
    match = tokens == drawn                                                          # [B, n]
    # of siblings sharing a token only the first can be entered, so the accepted nodes stay a chain
    twin = ((tokens[:, :, None] == tokens[:, None, :]) & tree.earlier_sibling).any(dim=2)
    match &= ~twin
    accepted = ~(tree.attn_mask & ~match[:, None, :]).any(dim=2)                     # [B, n]
    # ancestors have smaller indices, so the deepest accepted node is the largest; its row in y is j+1
    rows = accepted.long() * torch.arange(1, n + 1, device=y.device)                 # [B, n]
    last = torch.cat([rows.new_zeros(B, 1), rows], dim=1).amax(dim=1)                # [B], 0 = root
    return accepted, y.gather(1, last[:, None]).squeeze(1)


def verify_tree(
    p: torch.Tensor,       # [n+1, V] target probs: row 0 at the root, row j+1 after node j
    tree: Tree,
    tokens: torch.Tensor,  # [n] int64
    u: torch.Tensor,       # [n+1] uniforms in [0, 1), one per row of p
) -> tuple[list[int], int]:
    """Exact verification of a deterministic tree for one sequence.

    At each node on the walk the target draws y ~ p(node); if y is a child's token the walk moves
    there, else it stops and y is the final token. Each emitted token is therefore a sample from p
    given its prefix, for any tree and any temperature / top-k / top-p (already applied to p).
    Drawing all n+1 rows at once costs the same order as computing p itself and needs no Python
    loop and a single host sync; rows off the walk are simply unused.

    Returns (accepted node indices from the root down, the final token).
    """
    y = sample_from_probs(p, u)                                                      # [n+1]
    return _unpack(*accept_tree(y[None], tree, tokens[None]))


def verify_tree_greedy(
    target_argmax: torch.Tensor,  # [n+1] int64
    tree: Tree,
    tokens: torch.Tensor,         # [n] int64
) -> tuple[list[int], int]:
    """verify_tree with the target's argmax as its draw at every node."""
    return _unpack(*accept_tree(target_argmax[None], tree, tokens[None]))


def _unpack(accepted: torch.Tensor, final: torch.Tensor) -> tuple[list[int], int]:
    return accepted[0].nonzero().squeeze(1).tolist(), int(final[0])
