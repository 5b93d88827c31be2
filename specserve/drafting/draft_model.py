"""Draft-model drafting: a small causal LM with the target's tokenizer drafts token by token.

Its KV cache is its own tensor but shares the target's block tables, so slot i of a sequence holds
the draft's K/V for the same token as the target's slot i. seq.num_drafter_computed counts the
tokens whose draft K/V is valid; each proposal first catches up on the tokens committed since.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from specserve.runtime.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.runtime.sequence import Sequence
from specserve.models.config import ModelConfig
from specserve.models.registry import load_model
from specserve.drafting.proposer import Draft, Proposer, TargetHidden, draw_draft_tokens
from specserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_path: str | Path) -> None:
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise ValueError(f"the draft model in {draft_path} does not share the target's tokenizer "
                         f"(vocabulary sizes {draft.vocab_size} vs {target.vocab_size}, or different tokens)")


class DraftModelProposer(Proposer):
    uses_kv_cache = True
    name = "draft"

    def __init__(self, path: str | Path, engine):
        self.config = ModelConfig.from_pretrained(path)
        if (Path(path) / "tokenizer.json").exists():
            check_same_tokenizer(engine.tokenizer, Tokenizer.from_pretrained(path), path)
        elif self.config.vocab_size < engine.tokenizer.vocab_size:
            raise ValueError(f"the draft model in {path} has a vocabulary of {self.config.vocab_size} tokens, "
                             f"smaller than the target tokenizer's {engine.tokenizer.vocab_size}")
        if self.config.max_position_embeddings < engine.max_model_len:
            logger.warning("the draft model handles %d positions: max_model_len lowered from %d",
                           self.config.max_position_embeddings, engine.max_model_len)
            engine.max_model_len = self.config.max_position_embeddings
        self.model = load_model(path, engine.dtype, engine.device, self.config).pack(engine.device, engine.dtype)
        self.target_vocab = engine.model_config.vocab_size
        c = self.config
        self.kv_bytes_per_token = kv_cache_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, engine.dtype,
                                                   engine.device)
        self.pending: dict[int, tuple[int, int]] = {}     # seq_id -> (committed length, tokens drafted)

    def bind(self, engine) -> None:
        c = self.config
        self.runner = ModelRunner(self.model, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                  engine.block_manager.num_blocks, engine.block_manager.block_size,
                                  engine.dtype, engine.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden).float()
        V = self.target_vocab
        if logits.shape[-1] > V:
            return logits[:, :V]
        if logits.shape[-1] < V:
            return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        B, K = len(seqs), max(num_draft_tokens)
        sampled = [not seq.params.greedy for seq in seqs]
        probs = torch.zeros(B, K, self.target_vocab) if any(sampled) else None
        drafts: list[list[int]] = [[] for _ in seqs]
        # first forward: catch up on every committed token the draft has not seen, ending at the last
        items = [ForwardItem(seq.block_table, seq.num_drafter_computed, seq.token_ids[seq.num_drafter_computed:])
                 for seq in seqs]
        active = list(range(B))
        for j in range(K):
            h, _ = self.runner.forward(items)
            last = torch.tensor([len(it.token_ids) for it in items]).cumsum(0) - 1
            logits = self._logits(h[last])                                    # [b, V]
            # greedy rows in a batch with sampled ones get a one-hot q
            tokens, q = draw_draft_tokens(logits, [seqs[i] for i in active], j, probs is not None)
            if probs is not None:
                probs[torch.tensor(active), j] = q
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            if j == 0:
                for seq in seqs:
                    seq.num_drafter_computed = len(seq)
            active = [i for i in active if len(drafts[i]) < num_draft_tokens[i]]
            if not active:
                break
            items = [ForwardItem(seqs[i].block_table, len(seqs[i]) + j, [drafts[i][-1]]) for i in active]
        for seq, d in zip(seqs, drafts):
            self.pending[seq.seq_id] = (len(seq), len(d))
        return Draft(token_ids=drafts, probs=probs)

    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> None:
        for seq in seqs:
            pending = self.pending.pop(seq.seq_id, None)
            if pending is not None:
                committed, k = pending
                # the draft fed draft tokens 1..k-1 after the committed ones: valid while accepted
                seq.num_drafter_computed = min(committed + k - 1, seq.num_computed_tokens)

    def on_finished(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
