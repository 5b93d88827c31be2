"""Draft-model drafting: a small causal LM with the target's tokenizer drafts token by token.

Its KV cache is its own tensor but shares the target's block tables, so slot i of a sequence holds
the draft's K/V for the same token as the target's slot i. seq.num_drafter_computed counts the
tokens whose draft K/V is valid; each proposal first catches up on the tokens committed since: the one or two a
step that drafted leaves, in its first draft forward; a backlog of CATCH_UP_APART tokens or more (a prompt, the steps
"auto" held the sequence at 0), in a forward of its own, timed apart (Proposer.catch_up_seconds) so that "auto"
prices it per token caught up on (engine/step_costs.py) and not as the drafter's per-call cost.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from specserve.drafting.catch_up import timed
from specserve.drafting.options import CONFIDENCE_THRESHOLD
from specserve.drafting.proposer import Draft, DrafterContext, Proposer, TargetHidden, draft_chains
from specserve.drafting.token_map import ReducedHead, find_token_map
from specserve.models.config import ModelConfig
from specserve.models.registry import load_model
from specserve.runtime.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.runtime.sequence import Sequence
from specserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# a backlog of at least this many tokens runs in its own forward: merged into the first draft forward, a probe's
# catch-up over a 550-token sonnet prompt (~13 ms) was fitted as the draft call's cost (e 2.9 ms, against 0.9 from
# steps that drafted in a row), and "auto" at one sequence held drafts that ran 1.03x faster than plain decoding
CATCH_UP_APART = 8


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_path: str | Path) -> None:
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise ValueError(f"the draft model in {draft_path} does not share the target's tokenizer "
                         f"(vocabulary sizes {draft.vocab_size} vs {target.vocab_size}, or different tokens)")


class DraftModelProposer(Proposer):
    uses_kv_cache = True
    options = (CONFIDENCE_THRESHOLD,)
    name = "draft"
    uses_token_map = True

    def __init__(self, path: str | Path, ctx: DrafterContext):
        self.config = c = ModelConfig.from_pretrained(path)
        if (Path(path) / "tokenizer.json").exists():
            check_same_tokenizer(ctx.tokenizer, Tokenizer.from_pretrained(path), path)
        elif c.vocab_size < ctx.tokenizer.vocab_size:
            raise ValueError(f"the draft model in {path} has a vocabulary of {c.vocab_size} tokens, "
                             f"smaller than the target tokenizer's {ctx.tokenizer.vocab_size}")
        if c.max_position_embeddings < ctx.max_model_len:
            logger.warning("the draft model handles %d positions: max_model_len lowered from %d",
                           c.max_position_embeddings, ctx.max_model_len)
            self.max_model_len = c.max_position_embeddings
        model = load_model(path, ctx.dtype, ctx.device, c)
        self.target_vocab, self.device = ctx.target_config.vocab_size, ctx.device
        ids = find_token_map(ctx.token_map, Path(path), min(c.vocab_size, self.target_vocab))
        self.head = None if ids is None else ReducedHead(
            (model.model.embed_tokens if model.lm_head is None else model.lm_head).weight, ids, self.target_vocab, ctx.dtype,
            ctx.quantization)
        self.model = model.pack(ctx.device, ctx.dtype, ctx.quantization)
        self.runner = ModelRunner(self.model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                  ctx.num_blocks, ctx.block_size, ctx.dtype, ctx.device)
        self.pending: dict[int, tuple[int, int]] = {}     # seq_id -> (committed length, tokens drafted)
        logger.info("drafting with the draft model in %s%s", path,
                    "" if self.head is None else f" (its head over {self.head.size} mapped tokens)")

    @classmethod
    def create(cls, path: Path | None, ctx: DrafterContext) -> DraftModelProposer:
        return cls(path, ctx)

    @classmethod
    def kv_bytes_per_token(cls, path: Path | None, ctx: DrafterContext) -> int:
        c = ModelConfig.from_pretrained(path)
        return kv_cache_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, ctx.dtype, ctx.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden)      # hidden: after the final norm
        logits = self.model.compute_logits(hidden).float()
        V = self.target_vocab
        if logits.shape[-1] > V:
            return logits[:, :V]
        if logits.shape[-1] < V:
            return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        behind = [seq for seq in seqs if self.catch_up_tokens(seq)]
        self.catch_up_seconds = timed(self._catch_up, behind) if behind else None

        def step_logits(step: int, active: list[int], drafts: list[list[int]]) -> torch.Tensor:
            if step == 0:   # catch up on every committed token the draft has not seen, ending at the last
                items = [ForwardItem(seq.block_table, seq.num_drafter_computed, seq.token_ids[seq.num_drafter_computed:])
                         for seq in seqs]
            else:
                items = [ForwardItem(seqs[i].block_table, len(seqs[i]) + step - 1, drafts[i][-1:]) for i in active]
            h, _ = self.runner.forward(items)
            if step == 0:
                for seq in seqs:
                    seq.num_drafter_computed = len(seq)
            return self._logits(h[torch.tensor([len(it.token_ids) for it in items]).cumsum(0) - 1])    # [b, V]

        draft = draft_chains(seqs, num_draft_tokens, self.target_vocab, self.device, step_logits)
        for seq, d in zip(seqs, draft.token_ids):
            self.pending[seq.seq_id] = (len(seq), len(d))
        return draft

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Run the draft over each sequence's committed tokens it has not seen, but its last (the first draft step's)."""
        self.runner.forward([ForwardItem(seq.block_table, seq.num_drafter_computed,
                                         seq.token_ids[seq.num_drafter_computed:seq.num_computed_tokens])
                             for seq in seqs])
        for seq in seqs:
            seq.num_drafter_computed = seq.num_computed_tokens

    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> float:
        for seq in seqs:
            pending = self.pending.pop(seq.seq_id, None)
            if pending is not None:
                committed, k = pending
                # the draft fed draft tokens 1..k-1 after the committed ones: valid while accepted
                seq.num_drafter_computed = min(committed + k - 1, seq.num_computed_tokens)
        return 0.0

    def on_finished(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        """The backlog the next draft runs a forward over first (fewer tokens ride in the first draft forward)."""
        backlog = seq.num_computed_tokens - seq.num_drafter_computed
        return backlog if backlog >= CATCH_UP_APART else 0
