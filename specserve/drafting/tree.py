"""Token trees for tree drafting (EAGLE3): growing one (GrowingTree), and its exact verification (Tree).

A Tree is built once from a parent array; everything the engine needs per step (depths for
positions, the attention mask, the rows verification reads) is derived at construction, never per call.
"""
from dataclasses import dataclass, field

import torch

# nodes a request's draft tree may grow in one step (branching + branching^2 * (depth - 1)): the head
# runs branching * (depth - 1) of them and ranks them all, so this bounds the drafting time one request
# adds to a step; EAGLE-2's default tree (top-k 10, depth 6) grows 510
MAX_TREE_NODES = 1024


def grammar_filtered(logp: torch.Tensor, target_ids: torch.Tensor, grammars: list, trees: list, parents: list[int]
                     ) -> torch.Tensor:
    """logp [m, Vd] (row r: the children of node parents[r] of trees[r]; target_ids [Vd]: the target token of each
    draft token) without the children a request's grammar (grammars[r], None: none) forbids after their parent's
    path: the tree grows only acceptable nodes."""
    target_ids, logp = target_ids.cpu(), logp.clone()
    for r, (grammar, tree, parent) in enumerate(zip(grammars, trees, parents)):
        if grammar is None:
            continue
        path, node = [], parent
        while node >= 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        allowed = grammar.allowed([path[::-1]])[0][target_ids].to(logp.device)
        logp[r] = logp[r].masked_fill(~allowed, float("-inf"))
    return logp


def check_tree_shape(b: int, depth: int, k: int, auto: bool, draft_vocab_size: int) -> None:
    """A request's tree options against its draft length k (a fixed k must fit in the tree; "auto" chooses
    within it) and the drafter's draft vocabulary; ValueError names the offending option."""
    if depth <= 0:
        return
    if b * b * (depth - 1) + b < k and not auto:
        raise ValueError(f"a tree with branching_factor={b} and tree_depth={depth} has "
                         f"{b * b * (depth - 1) + b} nodes, fewer than num_assistant_tokens={k}")
    if k <= 0:
        return
    if b > draft_vocab_size:
        raise ValueError(f"branching_factor={b} is larger than the EAGLE3 head's draft vocabulary "
                         f"({draft_vocab_size} tokens)")
    depth = min(depth, k)                                               # the depth propose() grows
    if (nodes := b + b * b * (depth - 1)) > MAX_TREE_NODES:
        raise ValueError(f"a tree with branching_factor={b} and depth {depth} grows {nodes} nodes per step; "
                         f"at most {MAX_TREE_NODES} are allowed (lower branching_factor or tree_depth)")


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
    parent_rows: torch.Tensor = field(init=False)      # [n] int64, parents + 1: node j's row in p and y
    earlier_sibling: torch.Tensor = field(init=False)  # [n, n] bool: k is a sibling of j and k < j

    def __post_init__(self):
        n = self.num_nodes = len(self.parents)
        for j, parent in enumerate(self.parents):
            if not -1 <= parent < j:
                raise ValueError(f"parents[{j}] = {parent}: a parent must be -1 or an earlier node")
        depth = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        for j, parent in enumerate(self.parents):
            if parent >= 0:
                mask[j] |= mask[parent]
            depth[j] = 1 if parent < 0 else depth[parent] + 1
        parents = torch.tensor(self.parents, dtype=torch.long).reshape(n)
        self.depth = torch.tensor(depth, dtype=torch.long).reshape(n).to(self.device)
        self.attn_mask = mask.to(self.device)
        self.parent_rows = (parents + 1).to(self.device)
        index = torch.arange(n)
        earlier_sibling = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
        self.earlier_sibling = earlier_sibling.to(self.device)

    @classmethod
    def of(cls, parents: list[int] | None) -> "Tree | None":
        """The tree of a drafted parent array; None for a chain (or no parents), which needs no tree."""
        if parents is None or parents == list(range(-1, len(parents) - 1)):
            return None
        return cls(parents)

    def forward_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool: the target's mask over the last token (row 0) and the nodes; every row sees
        the last token, a node sees its ancestors and itself."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.attn_mask
        return mask

    def positions(self, start: int) -> list[int]:
        """Positions of the last token (at start) and the nodes (by depth below it)."""
        return [start] + (start + self.depth).tolist()


@dataclass(slots=True)
class GrowingTree:
    """One sequence's draft tree while it grows. Node j: token, parent (-1: the root), cumulative
    draft log-probability, level (1 for the root's children). Fed nodes have head K/V at scratch slots."""
    branching: int
    depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)            # nodes fed to the head, in slot order
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    root_output: torch.Tensor | None = None                 # the head's output at the last token

    def add_children(self, parent: int, tokens: list[int], logps: list[float], level: int) -> None:
        base = self.scores[parent] if parent >= 0 else 0.0
        for token, logp in zip(tokens[:self.branching], logps[:self.branching]):
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base + logp)
            self.levels.append(level)

    def best(self, nodes: list[int], n: int) -> list[int]:
        """The n best nodes by cumulative probability; ties go to the earlier node, so a parent always
        ranks before its children and the best n of the whole tree form a connected subtree."""
        return sorted(nodes, key=lambda j: (-self.scores[j], j))[:n]

    def to_expand(self, level: int) -> list[int]:
        return self.best([j for j, lv in enumerate(self.levels) if lv == level], self.branching)

    def is_ancestor(self, a: int, j: int) -> bool:
        while j >= 0:
            j = self.parents[j]
            if j == a:
                return True
        return False

    def select(self, k: int) -> tuple[list[int], list[int]]:
        """The best k nodes, in index order (ancestors first): (tokens, parents re-indexed)."""
        keep = sorted(self.best(list(range(len(self.tokens))), k))
        index = {j: i for i, j in enumerate(keep)}
        return [self.tokens[j] for j in keep], [index[self.parents[j]] if self.parents[j] >= 0 else -1 for j in keep]


def path_moves(first_node: int, path: list[int]) -> tuple[list[int], list[int]] | None:
    """(src, dst) slots that move an accepted path's K/V from its nodes' tree slots (node j at
    first_node + j) to consecutive ones; None when they are already in place. The other branches'
    entries stay behind, past the sequence's length, to be overwritten."""
    src = [first_node + j for j in path]
    dst = list(range(first_node, first_node + len(path)))
    return None if src == dst else (src, dst)


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


def scratch_tables(runner, bs: int, num_blocks: int, seqs: list, trees: dict[int, GrowingTree]) -> dict[int, list[int]]:
    """Block tables reaching past each sequence's own blocks (bs slots each; num_blocks in the drafter's cache,
    runner.kv_cache) into private scratch blocks, so a tree may feed more nodes than the slots the scheduler reserved
    (only the best k are verified)."""
    tables, next_block = {}, num_blocks
    for i, tree in trees.items():
        seq = seqs[i]
        need = -(-(seq.num_computed_tokens + 1 + tree.branching * (tree.depth - 1)) // bs)
        extra = max(0, need - len(seq.block_table))
        tables[i] = seq.block_table + list(range(next_block, next_block + extra))
        next_block += extra
    cache = runner.kv_cache
    if next_block * bs > cache.shape[1]:
        grown = cache.new_zeros(cache.shape[0], next_block * bs - cache.shape[1], *cache.shape[2:])
        runner.kv_cache = torch.cat([cache, grown], dim=1)
    return tables
