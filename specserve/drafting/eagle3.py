"""EAGLE3 drafting: a one-layer head that reads three of the target's hidden states.

The head's paged KV cache shares the target's block tables. Slot j holds the head's entry for
(fc(target states at j-1), token j) at rotary position j-1, whose output predicts token j+1; slot 0
holds nothing and is masked. A slot therefore depends only on tokens up to its own, so full blocks
are valid prefix-cache entries for the head too; the target's states at the last slot of every full block
(`block_tails`, fc applied at a restart) let a cache hit resume where a miss would, or restart past blocks
cached without the head's K/V (`catch_up.restart_at`: slots before seq.drafter_start masked too). The head
takes each target forward's committed states and runs over them (keeping `tail`, what its next slot reads)
as `catch_up.catch_up_now` says.

A draft is a tree grown level by level (a chain is the tree with branching 1 and depth k): the root
forward runs the last token from the tail; a drafted node feeds the head its parent's pre-norm output
and its own token, at scratch slots past the committed context where it sees only its ancestors.
Drafts are deterministic (top tokens), so the engine verifies them exactly by sampling from the target.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.drafting.options import CONFIDENCE_THRESHOLD, MAX_NUM_ASSISTANT_TOKENS, Option
from specserve.drafting.catch_up import (backlog_skip, catch_up_now, catch_up_rows, drop_rows, keep_block_tails,
                                         restart_at, restart_tail, timed)
from specserve.drafting.proposer import Draft, DrafterContext, Proposer, TargetHidden
from specserve.drafting.eagle3_check import check_acceptance
from specserve.drafting.tree import GrowingTree, check_tree_shape, grammar_filtered, scratch_tables
from specserve.models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3_head, resolve_aux_layers
from specserve.models.packing import pack_for_inference
from specserve.runtime.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.runtime.sequence import Sequence

logger = logging.getLogger(__name__)

# a sequence's committed target states wait as they are until the head runs over them or there are this many: then
# fc applies to them, with every other such sequence's, in one forward
RAW_ROWS = 64

@dataclass(slots=True)
class HeadState:
    num_computed: int                      # head slots [1, num_computed) hold K/V (== seq.num_drafter_computed)
    tail: torch.Tensor | None              # [H] fc(target states) at num_computed - 1: what the next slot reads
    root: torch.Tensor | None = None       # [H] the head's output at slot num_computed (the last token), once run
    pending: list[torch.Tensor] = field(default_factory=list)   # fc(target states) from num_computed, not run
    raw: list[torch.Tensor] = field(default_factory=list)       # the target's states after those, fc not applied
    num_pending: int = 0                   # rows of both, counted as they come (read for every sequence every step)
    num_raw: int = 0

    def skip(self, n: int) -> None:
        """Drop the first n rows waiting (catch_up.backlog_skip): the head restarts past them, at the next row."""
        fed = sum(len(rows) for rows in self.pending)
        self.pending, self.raw = drop_rows(self.pending, n), drop_rows(self.raw, max(0, n - fed))
        self.num_computed, self.num_pending, self.num_raw = self.num_computed + n, self.num_pending - n, \
            self.num_raw - max(0, n - fed)


class Eagle3Proposer(Proposer):
    uses_kv_cache = True
    name = "eagle3"

    options = (Option("branching_factor", 2, 1, "children per tree node (tree drafting)"),
               Option("tree_depth", 0, 0, "draft tree depth; 0 drafts a chain", off=0), CONFIDENCE_THRESHOLD)

    def __init__(self, path: str | Path, ctx: DrafterContext):
        target = ctx.target_config
        self.config = Eagle3Config.from_pretrained(path)
        self.layers = resolve_aux_layers(self.config.aux_layer_ids, target.num_hidden_layers)
        self.aux_layers = tuple(sorted(set(self.layers)))
        # the head reads the states concatenated in layer order, as vLLM and SGLang capture them
        self.aux_order = [self.aux_layers.index(i) for i in sorted(self.layers)]
        max_positions = max(self.config.layer.max_position_embeddings, ctx.max_model_len) + MAX_NUM_ASSISTANT_TOKENS
        self.head: Eagle3Head = load_eagle3_head(path, ctx.target.model.embed_tokens, target, ctx.dtype,
                                                 ctx.device, max_positions)
        pack_for_inference(self.head, ctx.device, ctx.dtype, ctx.quantization)
        c = self.config.layer
        self.block_size, self.num_blocks, self.window = ctx.block_size, ctx.num_blocks, ctx.catch_up_window
        self.dtype, self.device = ctx.dtype, ctx.device
        self.runner = ModelRunner(self.head, 1, c.num_key_value_heads, c.head_dim, self.num_blocks, self.block_size,
                                  self.dtype, self.device)
        self.block_tails = torch.zeros(self.num_blocks, self.config.states_width, dtype=self.dtype, device=self.device)
        self.states: dict[int, HeadState] = {}
        self.drafted: set[int] = set()         # sequences that drafted in the step under way
        written = "default" if self.config.aux_layer_ids is None else f"ids {self.config.aux_layer_ids} in its config"
        logger.info("EAGLE3 head %s reads the target's hidden states entering layers %s (%s, target of %d layers)",
                    path, list(self.layers), written, target.num_hidden_layers)
        check_acceptance(self.head, self.layers, ctx.target, ctx.tokenizer, self.dtype, self.device)

    @classmethod
    def create(cls, path: Path | None, ctx: DrafterContext) -> Eagle3Proposer:
        return cls(path, ctx)

    @classmethod
    def kv_bytes_per_token(cls, path: Path | None, ctx: DrafterContext) -> int:
        config = Eagle3Config.from_pretrained(path)
        c = config.layer
        tail_bytes = config.states_width * torch.empty((), dtype=ctx.dtype).element_size()
        kv_bytes = kv_cache_bytes_per_token(1, c.num_key_value_heads, c.head_dim, ctx.dtype, ctx.device)
        return kv_bytes + -(-tail_bytes // ctx.block_size)

    def check(self, params) -> None:
        settings = self.settings(params)
        check_tree_shape(settings["branching_factor"], settings["tree_depth"], self.max_draft_tokens(params),
                         params.auto_draft, self.config.draft_vocab_size)

    def _forward(self, items: list[ForwardItem], hidden: torch.Tensor,
                 earlier_nodes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Head forward over the items' new slots; hidden [N, H] is what each new slot reads. earlier_nodes[b]
        [n, m]: which of the m slots just before item b's start (tree nodes fed at earlier levels) each sees."""
        # a chain's next node sees every slot before it (its ancestors): a decode row, for the native kernel
        native = earlier_nodes is None or all(bool(seen.all()) for seen in earlier_nodes)
        input_ids, positions, ctx = self.runner.prepare(items, native)
        for call in ctx.calls if earlier_nodes and not native else []:
            for i, b in enumerate(call.items):
                seen, start = earlier_nodes[b], items[b].start
                call.attn_mask[i, 0, :seen.shape[0], start - seen.shape[1]:start] = seen.to(self.device)
        return self.head(input_ids, hidden, positions, ctx)

    # ---- catching up on the target ---------------------------------------------------------------
    def _state(self, seq: Sequence, first_row: int) -> HeadState | None:
        """Where the head resumes, the target's committed rows starting at first_row: its own state, or a restart
        where the engine reset the count (a new sequence, a preemption, a prefix-cache hit: the hit's last block
        holds the tail). None: a gap the head cannot fill (mid-block: no tail there); it stops drafting."""
        state = self.states.get(seq.seq_id)
        if state is not None and state.num_computed == seq.num_drafter_computed \
                and state.num_computed + state.num_pending == first_row:
            return state
        start = restart_at(seq, first_row)
        tail = restart_tail(self.block_tails, seq, self.block_size)
        return HeadState(0, None) if start == 0 else None if tail is None else HeadState(start, self.head.fc(tail[None])[0])

    @staticmethod
    def _item(seq: Sequence, *fields) -> ForwardItem:       # the head reads its cache from slot 1 or drafter_start
        return ForwardItem(*fields, context_from=max(1, seq.drafter_start))

    @torch.inference_mode()
    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> float:
        """Take the step's committed target states; the head runs over them when `catch_up_now` says, fc then or
        at RAW_ROWS: a sequence the policy holds at 0 costs a copy of its rows, not fc over a decode step's few rows
        (reading fc's weight each step, half of what an idle head cost a step at 8 sequences) nor a head forward."""
        work, rows = [], []
        for seq, seq_rows in zip(seqs, hidden.rows):
            if seq.is_finished or not seq_rows:
                continue
            state = self._state(seq, seq.num_computed_tokens - len(seq_rows))
            if state is None:
                self.states.pop(seq.seq_id, None)
                continue
            work.append((seq, state, len(seq_rows)))
            rows.extend(seq_rows)
        catch_up = []
        if work:
            rows_t = torch.tensor(rows, device=hidden.final.device)
            raw_all = torch.cat([hidden.aux[j][rows_t] for j in self.aux_order], dim=-1).to(self.dtype)
            for (seq, state, n), raw in zip(work, raw_all.split([n for _, _, n in work])):
                keep_block_tails(self.block_tails, seq, state.num_computed + state.num_pending, raw, self.block_size)
                state.raw.append(raw)
                state.num_pending += n
                state.num_raw += n
                self.states[seq.seq_id] = state
                if catch_up_now(seq, state.num_pending, self.drafted):
                    catch_up.append((seq, state))
            self._apply_fc([state for _, state, _ in work if state.num_raw >= RAW_ROWS])
        self.drafted = set()
        return timed(self._catch_up, catch_up)

    def _apply_fc(self, states: list[HeadState]) -> None:
        """fc over the states' raw rows, in one forward."""
        if states := [state for state in states if state.raw]:
            fed_all = self.head.fc(torch.cat([row for state in states for row in state.raw]))
            for state, fed in zip(states, fed_all.split([state.num_raw for state in states])):
                state.pending.append(fed)
                state.raw, state.num_raw = [], 0

    def _catch_up(self, work: list[tuple[Sequence, HeadState]]) -> None:
        """The head over each sequence's pending slots (those in the window), and its last token's (the next root)
        where its block exists."""
        restarts = set()
        for seq, state in work:
            if skip := backlog_skip(state.num_pending, self.window):
                state.skip(skip)
                restarts.add(seq.seq_id)
        self._apply_fc([state for _, state in work])
        items, inputs, owners = [], [], []
        for seq, state in work:
            fed = torch.cat(state.pending)
            if seq.seq_id in restarts:              # the first row left is the tail: the head's context starts after
                state.tail, fed, state.num_computed = fed[0], fed[1:], state.num_computed + 1
                seq.drafter_start = seq.num_drafter_computed = state.num_computed
            end = state.num_computed + len(fed)
            with_root = len(seq) == end + 1 and end < len(seq.block_table) * self.block_size
            reads = torch.cat(([] if state.tail is None else [state.tail[None]]) + [fed if with_root else fed[:-1]])
            last = end + 1 if with_root else end
            first = last - len(reads)                               # slot 1 when starting from nothing
            if len(reads):
                items.append(self._item(seq, seq.block_table, first, seq.token_ids[first:last], list(range(first - 1, last - 1))))
                inputs.append(reads)
                owners.append((state, with_root))
            state.num_computed, state.tail, state.root, state.pending, state.num_pending = end, fed[-1], None, [], 0
            seq.num_drafter_computed = end
        if items:
            out = self._forward(items, torch.cat(inputs))
            ends = torch.tensor([len(it.token_ids) for it in items]).cumsum(0) - 1
            for (state, with_root), row in zip(owners, ends.tolist()):
                if with_root:
                    state.root = out[row]

    def on_finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        return catch_up_rows(state.num_pending, self.window) if (state := self.states.get(seq.seq_id)) else 0

    # ---- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        trees: dict[int, GrowingTree] = {}
        self.catch_up_seconds = timed(self._catch_up, [
            (seq, state) for seq in seqs if (state := self.states.get(seq.seq_id)) is not None
            and state.num_pending and state.num_computed == seq.num_drafter_computed])
        self.drafted = {seq.seq_id for seq in seqs}
        for i, (seq, k) in enumerate(zip(seqs, num_draft_tokens)):
            state = self.states.get(seq.seq_id)
            if state is None or state.tail is None or state.num_computed != seq.num_computed_tokens \
                    or state.num_computed != seq.num_drafter_computed or len(seq) != state.num_computed + 1:
                continue
            settings = self.settings(seq.params)
            b, depth = settings["branching_factor"], settings["tree_depth"]
            trees[i] = GrowingTree(b, min(depth, k)) if depth > 0 else GrowingTree(1, k)
        if trees:
            self._grow(seqs, trees)
        token_ids, parents = [[] for _ in seqs], [[] for _ in seqs]
        for i, tree in trees.items():
            token_ids[i], parents[i] = tree.select(num_draft_tokens[i])
        return Draft(token_ids=token_ids, parents=parents)

    def _grow(self, seqs: list[Sequence], trees: dict[int, GrowingTree]) -> None:
        """The root forward runs each last token; level 1 is the root's top tokens; each further level
        expands the best `branching` nodes of the level above, each into its top `branching` children."""
        tables = scratch_tables(self.runner, self.block_size, self.num_blocks, seqs, trees)
        owners = list(trees)
        states = [self.states[seqs[i].seq_id] for i in owners]
        missing = [(i, state) for i, state in zip(owners, states) if state.root is None]
        if missing:   # the last token's slot was not in the block table at catch-up time
            items = [self._item(seqs[i], tables[i], seqs[i].num_computed_tokens, [seqs[i].last_token],
                                [seqs[i].num_computed_tokens - 1]) for i, _ in missing]
            out = self._forward(items, torch.stack([state.tail for _, state in missing]))
            for (_, state), row in zip(missing, out):
                state.root = row
        hidden = torch.stack([state.root for state in states])                                 # [m, H]
        for i, state in zip(owners, states):
            trees[i].root_output = state.root
        parents = [-1] * len(owners)
        log_thresholds = {i: math.log(t) if (t := self.settings(seqs[i].params)[CONFIDENCE_THRESHOLD.name]) > 0
                          else -math.inf for i in owners}
        level = 1
        while True:
            logp = torch.log_softmax(self.head.draft_logits(hidden).float(), dim=-1)                # [m, Vd]
            if any(seqs[i].grammar is not None for i in owners):
                logp = grammar_filtered(logp, self.head.target_ids(torch.arange(logp.shape[-1], device=logp.device)),
                                        [seqs[i].grammar for i in owners], [trees[i] for i in owners], parents)
            width = min(max(trees[i].branching for i in owners), logp.shape[-1])
            top = logp.topk(width, dim=-1)
            tokens = self.head.target_ids(top.indices).tolist()
            values = top.values.tolist()
            for r, (i, parent) in enumerate(zip(owners, parents)):
                trees[i].add_children(parent, tokens[r], values[r], level)
                if trees[i].branching == 1 and values[r][0] < log_thresholds[i]:
                    trees[i].depth = level       # a chain stops after a token the head is unsure of
            expand = [(i, j) for i, tree in trees.items() if tree.depth > level for j in tree.to_expand(level)]
            if not expand:
                return
            hidden = self._feed(seqs, trees, expand, tables, level)
            owners, parents = [i for i, _ in expand], [j for _, j in expand]
            level += 1

    def _feed(self, seqs: list[Sequence], trees: dict[int, GrowingTree], expand: list[tuple[int, int]],
              tables: dict[int, list[int]], level: int) -> torch.Tensor:
        """One head forward over the nodes being expanded (grouped by sequence, in `expand` order);
        returns their pre-norm outputs. A node reads its parent's output and its own token."""
        groups: dict[int, list[int]] = {}
        for i, j in expand:
            groups.setdefault(i, []).append(j)
        items, inputs, seen = [], [], []
        for i, nodes in groups.items():
            seq, tree = seqs[i], trees[i]
            start = seq.num_computed_tokens + 1 + len(tree.fed)     # after the root's slot and earlier nodes
            items.append(self._item(seq, tables[i], start, [tree.tokens[j] for j in nodes],
                                    [seq.num_computed_tokens - 1 + level] * len(nodes),
                                    torch.eye(len(nodes), dtype=torch.bool) if len(nodes) > 1 else None))
            inputs.extend(tree.outputs[tree.parents[j]] if tree.parents[j] >= 0 else tree.root_output for j in nodes)
            seen.append(torch.tensor([[tree.is_ancestor(f, j) for f in tree.fed] for j in nodes], dtype=torch.bool))
        out = self._forward(items, torch.stack(inputs), seen)                                    # [n, H]
        for (i, j), row in zip(expand, out):
            trees[i].outputs[j] = row
            trees[i].fed.append(j)
        return out
