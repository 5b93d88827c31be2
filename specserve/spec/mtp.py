"""MTP drafting: the target's own multi-token-prediction layers draft, sharing its embedding and head.

Draft step k runs MTP layer k - 1 (the last one again past N) on the token just drafted and the hidden
state the previous step produced (the target's, for the first step). The layers' KV caches share the
target's block tables; slot s of layer d holds the entry that reads token s and the previous layer's
output at s - 1 (see models/mtp.py), so after every target forward the layers catch up on the committed
tokens with the target's hidden states, and each sequence keeps only `tails`: the hidden states at the
last committed slot that the layers read next. The tails at the last slot of every full block are kept
too (`block_tails`), which is what lets a prefix-cache hit resume the layers exactly where a miss would.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.engine.sequence import Sequence
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.models.mtp import load_mtp
from specserve.spec.proposer import Draft, Proposer, TargetHidden

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MTPState:
    num_computed: int          # slots every MTP layer's cache holds (== seq.num_drafter_computed)
    tails: torch.Tensor        # [N, H] at slot num_computed - 1: the target's hidden state, then layers 0..N-2's outputs


class MTPProposer(Proposer):
    uses_kv_cache = True

    def __init__(self, path: str | Path | None, engine):
        self.target = engine.model
        self.mtp = load_mtp(path or engine.config.model, engine.model.config, engine.dtype, engine.device)
        c, N = self.mtp.config, self.mtp.num_layers
        self.block_size = engine.config.block_size
        self.dtype, self.device = engine.dtype, engine.device
        tail_bytes = N * c.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
        self.kv_bytes_per_token = (kv_cache_bytes_per_token(N, c.num_key_value_heads, c.head_dim, engine.dtype)
                                   + math.ceil(tail_bytes / self.block_size))
        self.states: dict[int, MTPState] = {}
        logger.info("drafting with the %d MTP layer(s) in %s", N, path or engine.config.model)
        k = engine.spec_defaults.num_assistant_tokens
        if k > N:
            logger.warning("num_assistant_tokens=%d but %d MTP layer(s): draft steps %d..%d reuse the last layer, "
                           "and acceptance falls past step %d", k, N, N + 1, k, N)

    def bind(self, engine) -> None:
        c, N = self.mtp.config, self.mtp.num_layers
        num_blocks = engine.block_manager.num_blocks
        self.runner = ModelRunner(self.mtp, N, c.num_key_value_heads, c.head_dim, num_blocks, self.block_size,
                                  self.dtype, self.device)
        self.block_tails = torch.zeros(num_blocks, N, c.hidden_size, dtype=self.dtype, device=self.device)

    def _state(self, seq: Sequence) -> MTPState:
        """The sequence's state, restarted where the engine reset its count (a new sequence, a preemption,
        a prefix-cache hit: the hit's last block holds the tails)."""
        state = self.states.get(seq.seq_id)
        start = seq.num_drafter_computed
        if state is None or state.num_computed != start:
            if start == 0:
                tails = self.block_tails.new_zeros(self.block_tails.shape[1:])
            else:
                assert start % self.block_size == 0, "a restarted drafter count is a cached prefix of whole blocks"
                tails = self.block_tails[seq.block_table[start // self.block_size - 1]].clone()
            state = self.states[seq.seq_id] = MTPState(start, tails)
        return state

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.target.model.embed_tokens(input_ids)
        return embeds.masked_fill((positions == 0)[:, None], 0.0)      # slot 0 reads nothing

    @torch.inference_mode()
    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> None:
        work: list[tuple[Sequence, MTPState, list[int]]] = []
        for seq, rows in zip(seqs, hidden.rows):
            if seq.is_finished or not rows:
                continue
            state = self._state(seq)
            first = seq.num_computed_tokens - len(rows)     # slot of the first committed row
            if first > state.num_computed:
                raise RuntimeError(f"MTP cache of sequence {seq.seq_id} fell behind: it holds "
                                   f"{state.num_computed} slots, the target's rows start at {first}")
            rows = rows[state.num_computed - first:]
            if rows:
                work.append((seq, state, rows))
        if not work:
            return
        items = [ForwardItem(seq.block_table, state.num_computed, seq.token_ids[state.num_computed:seq.num_computed_tokens])
                 for seq, state, _ in work]
        input_ids, positions, ctx = self.runner.prepare(items)
        embeds = self._embed(input_ids, positions)
        # sources[i]: what the current layer reads for sequence i, at slots num_computed - 1 .. end - 1
        sources = [torch.cat([state.tails[:1], hidden.final[rows]]) for _, state, rows in work]
        new_tails: list[list[torch.Tensor]] = [[] for _ in work]
        for layer in range(self.mtp.num_layers):
            for i, (seq, state, _) in enumerate(work):
                new_tails[i].append(sources[i][-1])
                self._keep_block_tails(seq, state.num_computed, layer, sources[i])
            out = self.mtp(layer, embeds, torch.cat([s[:-1] for s in sources]), positions, ctx)
            if layer + 1 < self.mtp.num_layers:
                sizes = [len(s) - 1 for s in sources]
                sources = [torch.cat([state.tails[layer + 1:layer + 2], o]) for (_, state, _), o in zip(work, out.split(sizes))]
        for (seq, state, _), tails in zip(work, new_tails):
            state.num_computed = seq.num_drafter_computed = seq.num_computed_tokens
            state.tails = torch.stack(tails)

    def _keep_block_tails(self, seq: Sequence, start: int, layer: int, source: torch.Tensor) -> None:
        """source holds slots start - 1 .. start + n - 1; store those that end a block."""
        bs = self.block_size
        for s in range(start + (-start - 1) % bs, start + len(source) - 1, bs):
            self.block_tails[seq.block_table[s // bs], layer] = source[s - start + 1]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int], hidden: TargetHidden | None) -> Draft:
        B, K, N = len(seqs), max(num_tokens), self.mtp.num_layers
        vocab = self.target.output_weight.shape[0]
        probs = torch.zeros(B, K, vocab, device=self.device) if any(not seq.params.greedy for seq in seqs) else None
        drafts: list[list[int]] = [[] for _ in seqs]
        states = [self._state(seq) for seq in seqs]
        assert all(st.num_computed == len(seq) - 1 for st, seq in zip(states, seqs)), "drafting sequences are caught up"
        outputs: list[torch.Tensor] = [states[i].tails[:0] for i in range(B)]   # previous step's rows, by sequence
        active = list(range(B))
        for step in range(K):
            layer = min(step, N - 1)
            if step < N:   # layer `step` covers slots c .. c + step: the last token, then the drafts so far
                items = [ForwardItem(seqs[i].block_table, states[i].num_computed, [seqs[i].last_token] + drafts[i])
                         for i in active]
                reads = [torch.cat([states[i].tails[step:step + 1], outputs[i]]) for i in active]
            else:          # the last layer again, one slot further, on its own previous output
                items = [ForwardItem(seqs[i].block_table, states[i].num_computed + step, drafts[i][-1:]) for i in active]
                reads = [outputs[i][-1:] for i in active]
            input_ids, positions, ctx = self.runner.prepare(items)
            out = self.mtp(layer, self._embed(input_ids, positions), torch.cat(reads), positions, ctx)
            rows = out.split([len(it.token_ids) for it in items])
            last = torch.stack([r[-1] for r in rows])
            tokens, q = self._choose(self.mtp.compute_logits(layer, last, self.target).float(),
                                     [seqs[i] for i in active], step, probs is not None)
            for n, i in enumerate(active):
                drafts[i].append(tokens[n])
                outputs[i] = rows[n]
            if probs is not None:
                probs[torch.tensor(active), step] = q
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            if not active:
                break
        return Draft(token_ids=drafts, probs=probs)

    @staticmethod
    def _choose(logits: torch.Tensor, seqs: list[Sequence], step: int, need_q: bool) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens (argmax for greedy requests, else sampled from q with the draft stream of
        per-position uniforms) and q (one-hot for greedy rows; None when not needed)."""
        greedy = all(s.params.greedy for s in seqs)
        if greedy and not need_q:
            return logits.argmax(dim=-1).tolist(), None
        dev = logits.device
        q = compute_probs(logits, torch.tensor([s.params.temperature for s in seqs], device=dev),
                          torch.tensor([s.params.top_k for s in seqs], device=dev),
                          torch.tensor([s.params.top_p for s in seqs], device=dev))
        if greedy:
            return q.argmax(dim=-1).tolist(), q
        u = position_uniforms([s.seed for s in seqs], [[len(s) + step] for s in seqs], stream=2)[:, 0]
        return sample_from_probs(q, u.to(dev)).tolist(), q

    def on_finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
