"""The proposer interface: every drafting method is one class implementing it. The engine loop (schedule, propose,
verify, accept) never changes when a method is added."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.drafting.options import AUTO_MAX_DRAFT_TOKENS, CATCH_UP_WINDOW, CONFIDENCE_THRESHOLD, Option
from specserve.drafting.tree import Tree
from specserve.layers.logits_processors import process_batch
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.models.config import ModelConfig
from specserve.sampling_params import sampling_tensors

if TYPE_CHECKING:
    from specserve.runtime.sequence import Sequence
    from specserve.sampling_params import SamplingParams
    from specserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """What a proposer is built from: the target parts a drafter may share or check itself against, and the
    KV layout its own cache must follow (the target's block tables index it)."""
    target: nn.Module                  # the target model: its embedding and head, its hidden states
    target_config: ModelConfig
    tokenizer: Tokenizer
    model_dir: Path                    # the target's folder (MTP layers may sit in its checkpoint)
    dtype: torch.dtype
    device: torch.device
    block_size: int
    num_blocks: int                    # 0 while the KV cache is being sized (kv_bytes_per_token)
    max_model_len: int
    options: dict[str, int]            # the engine-wide value of every option of the method, num_assistant_tokens too
    cross_request_cache: bool = True   # a drafter may learn from earlier requests (the n-gram cache)
    token_map: str | None = None       # --speculative-token-map: a file, "none", or None for the drafter's own
    quantization: str | None = None    # the target's --quantization, which a drafter's own weights take too
    catch_up_window: int = CATCH_UP_WINDOW   # a deferring drafter's catch-up, at most (0: the whole backlog)


@dataclass(slots=True)
class Draft:
    """One step's draft for a batch of sequences, from the proposer to verification.

    token_ids[i] are the draft tokens of sequence i (possibly empty). For a chain, token j follows token j-1; for a
    tree, parents[i][j] is the index of node j's parent in token_ids[i], -1 for a child of the last committed token
    (the root). probs, when the drafter sampled its tokens, holds q: probs[i, j] is the distribution node j was drawn
    from, over the target vocabulary (shape [B, K, V], rows past len(token_ids[i]) unused). None means deterministic
    drafts (verification treats them as one-hot q). trees[i] is the Tree of a tree-shaped row, None for a chain; the
    engine derives it once per step (`for_batch`), a proposer leaves it unset."""
    token_ids: list[list[int]]
    probs: torch.Tensor | None = None          # [B, K, V] float32
    parents: list[list[int] | None] | None = None   # tree drafts only
    trees: list[Tree | None] | None = None

    @classmethod
    def nothing(cls, batch_size: int) -> Draft:
        return cls([[] for _ in range(batch_size)], trees=[None] * batch_size)

    def for_batch(self, rows: list[int], batch_size: int, limits: list[int]) -> Draft:
        """This draft of the sequences at `rows` of a batch, as the whole batch's draft: row rows[j] holds
        sequence j's tokens cut to limits[j], its q and its tree (None for a chain); other rows draft nothing."""
        out = Draft.nothing(batch_size)
        out.parents = [None] * batch_size
        for j, (i, limit) in enumerate(zip(rows, limits)):
            ids = out.token_ids[i] = list(self.token_ids[j][:limit])
            if ids and self.parents is not None and self.parents[j] is not None:
                out.trees[i] = Tree.of(self.parents[j][:len(ids)])
                out.parents[i] = None if out.trees[i] is None else out.trees[i].parents
        if self.probs is not None:
            out.probs = self.probs.new_zeros(batch_size, *self.probs.shape[1:])
            out.probs[rows] = self.probs
        return out


@dataclass(slots=True)
class TargetHidden:
    """Hidden states of the target's last forward: final holds the target's last hidden state after the final norm
    for every token of that forward (flat, sequence after sequence); aux holds the residual stream entering each
    layer in Proposer.aux_layers, in that order. rows[i] lists, in token order, the rows of sequence i whose tokens
    were committed (a prompt chunk, or the last token plus the accepted draft tokens)."""
    final: torch.Tensor                        # [N, H]
    aux: list[torch.Tensor]                    # each [N, H]
    rows: list[list[int]]


def draw_draft_tokens(logits: torch.Tensor, seqs: list[Sequence], step: int, need_q: bool,
                      drafted: list[list[int]] | None = None, eos_ids: set[int] = frozenset()
                      ) -> tuple[list[int], torch.Tensor | None]:
    """logits [B, V] at draft step `step` -> (the draft tokens: argmax for greedy requests, else sampled from q
    with the draft stream of per-position uniforms; q [B, V], one-hot for greedy rows, None when not needed).
    Penalties and biases apply to the drafter's logits as to the target's, after drafted[b] (its tokens so far)."""
    logits = process_batch(logits, seqs, [[d] for d in drafted or [[] for _ in seqs]], eos_ids)
    greedy = all(s.params.greedy for s in seqs)
    if greedy and not need_q:
        return logits.argmax(dim=-1).tolist(), None
    q = compute_probs(logits, *sampling_tensors([s.params for s in seqs], 1, logits.device))
    if greedy:
        return q.argmax(dim=-1).tolist(), q
    u = position_uniforms([s.seed for s in seqs], [[len(s) + step] for s in seqs], stream=2)[:, 0]
    return sample_from_probs(q, u.to(logits.device)).tolist(), q


def draft_chains(seqs: list[Sequence], num_draft_tokens: list[int], vocab_size: int, device: torch.device,
                 step_logits: Callable[[int, list[int], list[list[int]]], torch.Tensor]) -> Draft:
    """The loop of every drafter that drafts chains token by token: at step j, step_logits(j, active, drafts)
    gives the logits [len(active), V] of the next token of the sequences at `active` (drafts[i]: i's tokens so
    far); a sequence leaves once it has num_draft_tokens[i] tokens, or after a token the drafter gave less than
    its request's assistant_confidence_threshold (as transformers stops its assistant). q is kept when some
    request samples."""
    B, K = len(seqs), max(num_draft_tokens)
    probs = torch.zeros(B, K, vocab_size, device=device) if any(not s.params.greedy for s in seqs) else None
    thresholds = [s.params.draft_options.get(CONFIDENCE_THRESHOLD.name, 0.0) for s in seqs]
    drafts: list[list[int]] = [[] for _ in seqs]
    active = list(range(B))
    for step in range(K):
        logits = step_logits(step, active, drafts)
        logits = grammar_constrained(logits, [seqs[i] for i in active], [drafts[i] for i in active])
        if any(seqs[i].grammar is not None for i in active):   # a token map may hold no token the grammar allows
            live = torch.isfinite(logits).any(dim=-1).tolist()
            if not all(live):
                active, logits = [i for i, ok in zip(active, live) if ok], logits[torch.tensor(live)]
                if not active:
                    break
        # greedy rows in a batch with sampled ones get a one-hot q
        tokens, q = draw_draft_tokens(logits, [seqs[i] for i in active], step, probs is not None,
                                      [drafts[i] for i in active])
        for i, token in zip(active, tokens):
            drafts[i].append(token)
        if probs is not None:
            probs[torch.tensor(active), step] = q
        unsure = set()
        if any(thresholds[i] > 0 for i in active):
            confidence = own_token_probability(logits, tokens, q, [seqs[i].params.greedy for i in active])
            unsure = {i for i, c in zip(active, confidence) if c < thresholds[i]}
        active = [i for i in active if len(drafts[i]) < num_draft_tokens[i] and i not in unsure]
        if not active:
            break
    return Draft(token_ids=drafts, probs=probs)


def grammar_constrained(logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
    """logits [B, V] of the next draft token, without what a request's grammar forbids after its draft so far: a
    drafter that follows the grammar proposes tokens verification can accept."""
    if all(seq.grammar is None for seq in seqs):
        return logits
    logits = logits.clone()
    for b, (seq, tokens) in enumerate(zip(seqs, drafted)):
        if seq.grammar is not None:
            allowed = seq.grammar.allowed([tokens])[0].to(logits.device)
            width = min(allowed.shape[0], logits.shape[1])
            logits[b, :width] = logits[b, :width].masked_fill(~allowed[:width], float("-inf"))
    return logits


def own_token_probability(logits: torch.Tensor, tokens: list[int], q: torch.Tensor | None, greedy: list[bool]
                          ) -> list[float]:
    """The drafter's probability of each token it drew: from q where the row sampled, else the softmax of its
    logits (a greedy row's q is one-hot)."""
    probs = torch.softmax(logits.float(), dim=-1)
    if q is not None and not all(greedy):
        sampled = torch.tensor([not g for g in greedy], device=probs.device)
        probs = torch.where(sampled[:, None], q.to(probs.dtype), probs)
    return probs.gather(1, torch.tensor(tokens, device=probs.device)[:, None]).view(-1).tolist()


class Proposer(ABC):
    """A drafting method.

    propose() is called once per engine step with the decoding sequences that want drafts and
    how many tokens each may draft (>= 1). It may keep per-sequence state keyed by seq.seq_id,
    and must drop it in on_finished().
    """
    #: layers whose input hidden states the target must return (EAGLE3); () for none
    aux_layers: tuple[int, ...] = ()
    #: True when the proposer keeps a KV cache that shares the target's block tables
    uses_kv_cache: bool = False
    #: the method's name, as --speculative-method spells it
    name: str = ""
    #: the per-request settings the method reads, besides num_assistant_tokens (drafting/options.py)
    options: tuple[Option, ...] = ()
    #: the longest context the drafter handles, when shorter than the target's (the engine's limit follows)
    max_model_len: int | None = None
    #: True when its head can be cut to a token map (drafting/token_map.py)
    uses_token_map: bool = False
    #: seconds the last propose() spent catching up, timed apart from its drafting; None where the two share forwards
    catch_up_seconds: float | None = None

    @classmethod
    def create(cls, path: Path | None, ctx: DrafterContext) -> Proposer:
        """The proposer, ready to draft: weights loaded, its KV cache (ctx.num_blocks blocks) allocated."""
        return cls()

    @classmethod
    def kv_bytes_per_token(cls, path: Path | None, ctx: DrafterContext) -> int:
        """Bytes per token of the drafter's own KV cache and per-block state, from its config alone (the engine
        splits its KV budget before anything is loaded)."""
        return 0

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError when a request's resolved settings (params.draft_options holds every option of the
        method) ask more of this method than it can serve; called when the request is admitted, so that no step
        fails on them."""

    def settings(self, params: SamplingParams) -> dict[str, int]:
        """The request's value of each of the method's options (its default where unresolved)."""
        return {o.name: params.draft_options.get(o.name, o.default) for o in self.options}

    def max_draft_tokens(self, params: SamplingParams) -> int:
        """How many tokens a request drafts per step at most (its resolved num_assistant_tokens; the longest
        draft the engine's policy may choose for "auto")."""
        return AUTO_MAX_DRAFT_TOKENS if params.auto_draft else params.num_assistant_tokens or 0

    def draftable(self, seq: Sequence, k: int) -> int:
        """How many of k draft tokens propose() would return for seq now: k for a model, fewer where a lookup finds
        fewer. The scheduler reserves that many slots (the rest go to prompt chunks), and "auto" weighs that many."""
        return k

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        ...

    def on_target_forward(self, seqs: list[Sequence], hidden: TargetHidden) -> float:
        """Called after every target forward, once its drafts are verified, with the hidden states of the committed
        tokens (heads that read the target's states catch up here). Returns the seconds of its forwards: drafting's."""
        return 0.0

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Committed tokens the drafter would run over before its next draft for seq (what drafting after a
        pause costs beyond the draft itself: the policy weighs it)."""
        return 0

    def on_finished(self, seq: Sequence) -> None:
        """Called once when a sequence finishes or is aborted."""


class NoProposer(Proposer):
    """Plain decoding: no request drafts, so the engine's loop needs no special case for it."""
    name = "none"

    def max_draft_tokens(self, params: SamplingParams) -> int:
        return 0

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        return Draft([[] for _ in seqs])
