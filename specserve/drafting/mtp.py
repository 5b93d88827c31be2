"""MTP drafting: the target's own multi-token-prediction layers draft, sharing its embedding and head.

Draft step k runs MTP layer k - 1 (the last one again past N) on the token just drafted and the hidden
state the previous step produced (the target's, for the first step). The layers' KV caches share the
target's block tables; slot s of layer d holds the entry that reads token s and the previous layer's
output at s - 1 (see models/mtp.py), so after every target forward the layers catch up on the committed
tokens with the target's hidden states, and each sequence keeps only `tails`: the hidden states at the
last committed slot that the layers read next. The tails at the last slot of every full block are kept
too (`block_tails`), which is what lets a prefix-cache hit resume the layers exactly where a miss would.
Where its block exists, the catch-up also runs the last token's slot, so the first draft step needs no
forward of its own (`root`).

A sequence that did not draft in a step does not catch up after it: the target's hidden states of its new
tokens wait in `pending` until it drafts again (the catch-up then runs them in one forward; see
`catch_up.catch_up_now`). With "auto" choosing 0, or a request that drafts nothing, the layers cost nothing.
After a prefix-cache hit on blocks cached without the layers' K/V, they restart past them
(`catch_up.restart_at`), reading their own cache from seq.drafter_start on.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.drafting.options import CONFIDENCE_THRESHOLD
from specserve.drafting.catch_up import (backlog_skip, catch_up_now, catch_up_rows, drop_rows, keep_block_tails,
                                         restart_at, restart_tail, timed)
from specserve.drafting.proposer import Draft, DrafterContext, Proposer, TargetHidden, draft_chains
from specserve.drafting.token_map import ReducedHead, find_token_map
from specserve.models.config import ModelConfig
from specserve.models.loader import read_tensor
from specserve.models.mtp import load_mtp
from specserve.models.packing import pack_for_inference
from specserve.runtime.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.runtime.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MTPState:
    num_computed: int          # slots every MTP layer's cache holds (== seq.num_drafter_computed)
    tails: torch.Tensor        # [N, H] at slot num_computed - 1: the target's hidden state, then layers 0..N-2's outputs
    root: torch.Tensor | None = None   # [N, H] each layer's output at slot num_computed (the last token), when
                                       # the catch-up could run that slot too: drafting starts from it
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, H] target states of the committed slots
                                       # from num_computed on, not yet run through the layers
    num_pending: int = 0               # their rows, counted as they come (read for every sequence every step)


class MTPProposer(Proposer):
    uses_kv_cache = True
    options = (CONFIDENCE_THRESHOLD,)
    name = "mtp"
    uses_token_map = True

    def __init__(self, path: str | Path | None, ctx: DrafterContext):
        self.target = ctx.target
        source = path or ctx.model_dir
        mtp = load_mtp(source, ctx.target_config, ctx.dtype, ctx.device)
        self.heads = self._reduced_heads(mtp, find_token_map(ctx.token_map, Path(source), ctx.target_config.vocab_size), ctx)
        self.mtp = pack_for_inference(mtp, ctx.device, ctx.dtype, ctx.quantization)
        c, N = self.mtp.config, self.mtp.num_layers
        self.block_size, self.window = ctx.block_size, ctx.catch_up_window
        self.dtype, self.device = ctx.dtype, ctx.device
        self.runner = ModelRunner(self.mtp, N, c.num_key_value_heads, c.head_dim, ctx.num_blocks, self.block_size,
                                  self.dtype, self.device)
        self.block_tails = torch.zeros(ctx.num_blocks, N, c.hidden_size, dtype=self.dtype, device=self.device)
        self.states: dict[int, MTPState] = {}
        self.drafted: set[int] = set()     # the sequences the current step drafts for
        logger.info("drafting with the %d MTP layer(s) in %s%s", N, source,
                    f" (heads over {self.heads[0].size} mapped tokens)" if self.heads[0] is not None else "")
        if isinstance(k := ctx.options["num_assistant_tokens"], int) and k > N:
            logger.warning("num_assistant_tokens=%d but %d MTP layer(s): draft steps %d..%d reuse the last layer, "
                           "and acceptance falls past step %d", k, N, N + 1, k, N)

    def _reduced_heads(self, mtp, ids: torch.Tensor | None, ctx: DrafterContext) -> list[ReducedHead | None]:
        """Each layer's head over the token map's rows (None: its full head)."""
        if ids is None:
            return [None] * mtp.num_layers
        target_head = None
        heads = []
        for layer in range(mtp.num_layers):
            weight = mtp.head_weight(layer, self.target)
            if weight is None:      # the target's packed head: its rows from the checkpoint, read once
                if target_head is None:
                    target_head = read_tensor(ctx.model_dir, "lm_head.weight")
                    if target_head is None:
                        raise ValueError(f"no lm_head.weight in {ctx.model_dir} to cut to the token map; "
                                         f"pass --speculative-token-map none")
                weight = target_head
            heads.append(ReducedHead(weight.to(ctx.device), ids, ctx.target_config.vocab_size, ctx.dtype,
                                     ctx.quantization))
        return heads

    @classmethod
    def create(cls, path: Path | None, ctx: DrafterContext) -> MTPProposer:
        return cls(path, ctx)

    @classmethod
    def kv_bytes_per_token(cls, path: Path | None, ctx: DrafterContext) -> int:
        c, N = ctx.target_config, ModelConfig.from_pretrained(path or ctx.model_dir).num_nextn_predict_layers
        tail_bytes = N * c.hidden_size * torch.empty((), dtype=ctx.dtype).element_size()
        kv_bytes = kv_cache_bytes_per_token(N, c.num_key_value_heads, c.head_dim, ctx.dtype, ctx.device)
        return kv_bytes + math.ceil(tail_bytes / ctx.block_size)

    def _state(self, seq: Sequence, first_row: int) -> MTPState:
        """The sequence's state, holding the target's states up to its rows from first_row at least, or restarted
        where the engine reset its count (a new sequence, a preemption, a prefix-cache hit: the hit's last block
        holds the tails; past the layers' K/V only the target's state there is known, the rest reads nothing)."""
        state = self.states.get(seq.seq_id)
        if state is None or state.num_computed != seq.num_drafter_computed \
                or not first_row <= state.num_computed + state.num_pending <= seq.num_computed_tokens:
            start = restart_at(seq, first_row)
            tails = restart_tail(self.block_tails, seq, self.block_size)
            if tails is None:
                tails = self.block_tails.new_zeros(self.block_tails.shape[1:])
            elif seq.drafter_start:
                tails[1:] = 0
            state = self.states[seq.seq_id] = MTPState(start, tails)
        return state

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.target.model.embed_tokens(input_ids)
        return embeds.masked_fill((positions == 0)[:, None], 0.0)      # slot 0 reads nothing

    @torch.inference_mode()
    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> float:
        """Take the step's committed hidden states; run the layers over them when `catch_up_now` says."""
        work: list[tuple[Sequence, MTPState]] = []
        for seq, rows in zip(seqs, hidden.rows):
            if seq.is_finished or not rows:
                continue
            first = seq.num_computed_tokens - len(rows)         # slot of the first committed row
            state = self._state(seq, first)
            have = state.num_computed + state.num_pending       # slots whose target state is held
            if rows := rows[have - first:]:
                state.pending.append(fed := hidden.final[rows])   # indexing by a list copies the rows
                state.num_pending += len(fed)
                keep_block_tails(self.block_tails[:, 0], seq, have, fed, self.block_size)   # a restart point
            if catch_up_now(seq, state.num_pending, self.drafted):
                work.append((seq, state))
        self.drafted = set()
        return timed(self._catch_up, work)

    def _catch_up(self, work: list[tuple[Sequence, MTPState]]) -> None:
        """Run every layer over each sequence's pending slots (those in the window), and its last token's where its
        block exists."""
        if not work:
            return
        for seq, state in work:
            if skip := backlog_skip(state.num_pending, self.window):    # restart at the row after: the layers' tails
                rows = drop_rows(state.pending, skip)                  # there are unknown, as at a prefix-cache hit's
                state.tails = torch.cat([rows[0][:1], torch.zeros_like(state.tails[1:])])
                state.pending, state.num_pending = [torch.cat(rows)[1:]], state.num_pending - skip - 1
                state.num_computed = seq.drafter_start = seq.num_drafter_computed = state.num_computed + skip + 1
        # the last token's slot too, when the sequence decodes and its block exists: the first draft step is
        # then done here, in the same forward (the slot is recomputed with the committed ones next time)
        roots = [len(seq) == seq.num_computed_tokens + 1 and len(seq) <= len(seq.block_table) * self.block_size
                 for seq, _ in work]
        items = [ForwardItem(seq.block_table, state.num_computed,
                             seq.token_ids[state.num_computed:seq.num_computed_tokens + root],
                             context_from=seq.drafter_start) for (seq, state), root in zip(work, roots)]
        input_ids, positions, ctx = self.runner.prepare(items)
        embeds = self._embed(input_ids, positions)
        # sources[i]: what the current layer reads for sequence i, at slots num_computed - 1 .. end - 1
        sources = [torch.cat([state.tails[:1], *state.pending]) for _, state in work]
        new_tails: list[list[torch.Tensor]] = [[] for _ in work]
        root_outputs: list[list[torch.Tensor]] = [[] for _ in work]
        for layer in range(self.mtp.num_layers):
            for i, (seq, state) in enumerate(work):
                new_tails[i].append(sources[i][-1])
                if layer:                   # the target's states: kept as they arrived
                    keep_block_tails(self.block_tails[:, layer], seq, state.num_computed, sources[i][1:], self.block_size)
            reads = [src if root else src[:-1] for src, root in zip(sources, roots)]
            out = self.mtp(layer, embeds, torch.cat(reads), positions, ctx).split([len(r) for r in reads])
            for i, root in enumerate(roots):
                if root:
                    root_outputs[i].append(out[i][-1])
            if layer + 1 < self.mtp.num_layers:
                sources = [torch.cat([state.tails[layer + 1:layer + 2], o[:len(src) - 1]])
                           for (_, state), o, src in zip(work, out, sources)]
        for (seq, state), tails, root in zip(work, new_tails, root_outputs):
            state.num_computed = seq.num_drafter_computed = seq.num_computed_tokens
            state.tails = torch.stack(tails)
            state.root = torch.stack(root) if root else None
            state.pending, state.num_pending = [], 0

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        N = self.mtp.num_layers
        states = [self._state(seq, seq.num_computed_tokens) for seq in seqs]
        self.catch_up_seconds = timed(self._catch_up, [(seq, st) for seq, st in zip(seqs, states) if st.pending])
        self.drafted = {seq.seq_id for seq in seqs}
        assert all(st.num_computed == len(seq) - 1 for st, seq in zip(states, seqs)), "drafting sequences are caught up"
        outputs = [st.tails[:0] for st in states]          # each sequence's rows of the previous step
        last: list[torch.Tensor] = [st.tails[0] for st in states]   # its last output

        def step_logits(step: int, active: list[int], drafts: list[list[int]]) -> torch.Tensor:
            layer = min(step, N - 1)
            runs: list[tuple[int, ForwardItem, torch.Tensor]] = []
            for i in active:
                seq, state = seqs[i], states[i]
                c = state.num_computed
                if step < N:   # layer `step` covers slots c .. c + step (the last token, then the drafts so far),
                    # but for slot c when the catch-up ran it; it reads the layer before at the slot before
                    first = c + (state.root is not None)
                    before = state.tails[step:step + 1] if state.root is None else state.root[step - 1:step]
                    if first <= c + step:
                        item = ForwardItem(seq.block_table, first, ([seq.last_token] + drafts[i])[first - c:],
                                           context_from=seq.drafter_start)
                        runs.append((i, item, torch.cat([before, outputs[i]])))
                    else:      # step 0, done by the catch-up
                        outputs[i], last[i] = state.root[:0], state.root[0]
                else:          # the last layer again, one slot further, on its own previous output
                    runs.append((i, ForwardItem(seq.block_table, c + step, drafts[i][-1:],
                                                context_from=seq.drafter_start), last[i][None]))
            if runs:
                input_ids, positions, ctx = self.runner.prepare([item for _, item, _ in runs])
                out = self.mtp(layer, self._embed(input_ids, positions), torch.cat([r for _, _, r in runs]), positions, ctx)
                for (i, item, _), rows in zip(runs, out.split([len(item.token_ids) for _, item, _ in runs])):
                    outputs[i], last[i] = rows, rows[-1]
            hidden = torch.stack([last[i] for i in active])
            return self.mtp.compute_logits(layer, hidden, self.target, self.heads[layer]).float()

        return draft_chains(seqs, num_draft_tokens, self.target.config.vocab_size, self.device, step_logits)

    def on_finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        return catch_up_rows(state.num_pending, self.window) if (state := self.states.get(seq.seq_id)) else 0
