"""N-gram drafting: prompt lookup in the request's own tokens, then a cross-request n-gram cache.

No model is run; drafts are deterministic chains (probs None, parents None).
"""
from __future__ import annotations

import collections.abc
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specserve.drafting.options import Option
from specserve.drafting.proposer import Draft, DrafterContext, Proposer

if TYPE_CHECKING:
    from specserve.runtime.sequence import Sequence
    from specserve.sampling_params import SamplingParams

NORMAL_FINISH_REASONS = ("stop", "length")


def check_lookup_range(min_n: int, max_n: int) -> None:
    if min_n < 1:
        raise ValueError(f"prompt_lookup_min must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({min_n}), got {max_n}")


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Prompt lookup: up to k tokens that followed an earlier occurrence of the context's suffix.

    The longest suffix (max_n down to min_n tokens) with an earlier occurrence wins; among its
    occurrences the most recent one. Empty when no suffix of at least min_n tokens recurs.
    """
    check_lookup_range(min_n, max_n)
    tokens = np.asarray(tokens)
    if k <= 0 or len(tokens) <= min_n:
        return tokens[:0].copy()
    # ends[i] is the last position of an occurrence matching the last n tokens. Occurrences end at
    # most at len - 2: the suffix never matches itself and a continuation token always exists.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])   # ascending, so ends[-1] is the most recent
    n = 1
    while len(ends) and n < max_n:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[-1 - n]]
        if len(longer) == 0:
            break
        ends, n = longer, n + 1
    if len(ends) == 0 or n < min_n:
        return tokens[:0].copy()
    start = ends[-1] + 1
    return tokens[start:start + k].copy()


class NgramCache:
    """Cross-request n-gram statistics, in the spirit of llama.cpp's lookup cache.

    Every n-gram (min_n <= n <= max_n) of a finished request's tokens maps to counts of the token
    that followed it. At most max_entries n-grams are kept: the least recently used one (recorded
    or drafted from) is evicted first. A continuation is drafted only when it was seen at least
    min_count times and makes up at least min_share of its n-gram's continuations; the defaults
    (1, 0.0) draft any continuation ever seen. Ties go to the continuation recorded first.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, max_entries: int = 1_000_000,
                 min_count: int = 1, min_share: float = 0.0):
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_entries = max_entries
        self.min_count = min_count
        self.min_share = min_share
        self._next_counts: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next_counts)

    def __contains__(self, ngram: tuple[int, ...]) -> bool:
        return ngram in self._next_counts

    def update(self, tokens: collections.abc.Sequence[int]) -> None:
        """Record every n-gram of tokens with the token that followed it."""
        tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        next_counts = self._next_counts
        for n in range(self.min_n, self.max_n + 1):
            ngrams = zip(*(tokens[i:len(tokens) - n + i] for i in range(n)))
            for ngram, next_token in zip(ngrams, tokens[n:]):
                counts = next_counts.get(ngram)
                if counts is None:
                    counts = next_counts[ngram] = {}
                    if len(next_counts) > self.max_entries:
                        next_counts.popitem(last=False)
                else:
                    next_counts.move_to_end(ngram)
                counts[next_token] = counts.get(next_token, 0) + 1

    def draft(self, context: np.ndarray, k: int) -> list[int]:
        """Chain up to k tokens, each continuing the longest known n-gram of context + drafted."""
        tail = np.asarray(context[-self.max_n:]).tolist()
        drafted: list[int] = []
        while len(drafted) < k:
            token = self._next_token(tail)
            if token is None:
                break
            drafted.append(token)
            tail = (tail + [token])[-self.max_n:]
        return drafted

    def _next_token(self, tail: list[int]) -> int | None:
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            ngram = tuple(tail[-n:])
            counts = self._next_counts.get(ngram)
            if counts is None:
                continue
            self._next_counts.move_to_end(ngram)
            token, count = max(counts.items(), key=lambda item: item[1])
            if count >= self.min_count and count >= self.min_share * sum(counts.values()):
                return token
        return None


@dataclass(slots=True)
class TokenBuffer:
    """A numpy copy of seq.token_ids, appended to while the list only grows."""
    data: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_tokens: int = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = self.num_tokens
        # A shorter list, or a changed last-seen token, means the sequence was rewritten: rebuild.
        if len(token_ids) < n or (n and token_ids[n - 1] != self.data[n - 1]):
            n = 0
        new_tokens = token_ids[n:]
        total = n + len(new_tokens)
        if total > len(self.data):
            grown = np.empty(max(total, 2 * len(self.data)), dtype=self.data.dtype)
            grown[:n] = self.data[:n]
            self.data = grown
        self.data[n:total] = new_tokens
        self.num_tokens = total
        return self.data[:total]


class NgramProposer(Proposer):
    """Prompt lookup in each request's own tokens; when that finds nothing, the cross-request cache."""
    name = "ngram"
    options = (Option("prompt_lookup_min", 2, 1, "smallest n-gram matched"),
               Option("prompt_lookup_max", 4, 1, "largest n-gram matched", aliases=("max_ngram_size",)))

    def __init__(self, use_cache: bool = True, cache: NgramCache | None = None):
        self.cache: NgramCache | None = None
        if use_cache:
            self.cache = cache if cache is not None else NgramCache()
        self._buffers: dict[int, TokenBuffer] = {}
        self._ready: dict[int, tuple[int, int, list[int]]] = {}   # seq id -> (its length, k, draft): draftable()'s

    @classmethod
    def create(cls, path, ctx: DrafterContext) -> NgramProposer:
        return cls(use_cache=ctx.cross_request_cache)

    def check(self, params: SamplingParams) -> None:
        check_lookup_range(*self.lookup_range(params))

    def lookup_range(self, params: SamplingParams) -> tuple[int, int]:
        settings = self.settings(params)
        return settings["prompt_lookup_min"], settings["prompt_lookup_max"]

    def draftable(self, seq: Sequence, k: int) -> int:
        """The lookup's length, its draft kept for propose() in the same step (the scheduler asks first)."""
        draft = self.lookup(seq, k)
        self._ready[seq.seq_id] = (len(seq.token_ids), k, draft)
        return len(draft)

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> Draft:
        token_ids: list[list[int]] = []
        for seq, k in zip(seqs, num_draft_tokens):
            length, most, draft = self._ready.pop(seq.seq_id, (-1, 0, []))
            token_ids.append(draft[:k] if length == len(seq.token_ids) and k <= most else self.lookup(seq, k))
        return Draft(token_ids=token_ids)

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens: prompt lookup in the sequence's tokens, else the cross-request cache's chain."""
        min_n, max_n = self.lookup_range(seq.params)
        buffer = self._buffers.get(seq.seq_id)
        if buffer is None:
            buffer = self._buffers[seq.seq_id] = TokenBuffer()
        context = buffer.sync(seq.token_ids)
        draft = find_ngram_draft(context, min_n, max_n, k).tolist()
        if not draft and self.cache is not None:
            draft = self.cache.draft(context, k)
        return draft

    def on_finished(self, seq: Sequence) -> None:
        self._buffers.pop(seq.seq_id, None)
        self._ready.pop(seq.seq_id, None)
        if self.cache is not None and seq.finish_reason in NORMAL_FINISH_REASONS:
            self.cache.update(seq.token_ids)
