"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice of strings or a Lark
grammar), compiled by llguidance, the grammar engine llama.cpp and vLLM use.

Under speculation the grammar acts at three points (engine/llm_engine.py): a draft is cut at its first token the
grammar rejects, before the verify forward; each verified row's p is masked with the grammar's state after the
tokens before that row; the committed tokens advance the grammar. So the output always parses, and greedy
speculation equals greedy plain decoding under the grammar.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One of: json (a JSON schema, as a dict or its JSON text), json_object (any JSON object), regex, choice
    (one of these strings), grammar (Lark, llguidance's dialect; a GBNF grammar is converted)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice and grammar")
        if self.choice is not None and not self.choice:
            raise ValueError("a choice needs at least one string")

    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher, gbnf_to_lark
        # compact JSON (", " and ": " separators, no free whitespace): a small model given free whitespace can
        # fill max_tokens with newlines and never close the object
        compact = {"whitespace_flexible": False}
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return LLMatcher.grammar_from_json_schema(schema, overrides=compact)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        lark = self.grammar if "::=" not in self.grammar else gbnf_to_lark(self.grammar)
        return LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    """The model's tokenizer, as llguidance needs it (built once per engine, on the first structured request)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None

    def matcher(self, spec: StructuredOutput) -> Grammar:
        """ValueError naming the problem when the grammar does not compile."""
        from llguidance import LLMatcher, LLTokenizer
        if self._ll is None:
            self._ll = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                   eos_token=sorted(self.tokenizer.eos_token_ids))
        try:
            grammar = spec.llguidance_grammar()
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"invalid structured output: {e}") from e
        error = LLMatcher.validate_grammar(grammar, self._ll)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid structured output: {error}")
        matcher = LLMatcher(self._ll, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """One request's grammar state: advanced by its committed tokens only (probes roll back)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, after the committed ones, the grammar accepts in a row."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def allowed(self, prefixes: list[list[int]]) -> torch.Tensor:
        """[len(prefixes), V] bool: the tokens allowed after the committed ones and then each prefix (every
        prefix valid: drafts are cut before)."""
        rows = []
        for prefix in prefixes:
            consumed = self.matcher.try_consume_tokens(prefix) if prefix else 0
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            rows.append(torch.from_numpy(bits[:self.vocab_size].astype(bool)))
            if consumed:
                self.matcher.rollback(consumed)
        return torch.stack(rows)

    def commit(self, tokens: list[int]) -> None:
        self.matcher.consume_tokens(tokens)


def cut_at_grammar(draft, seqs: list) -> object:
    """The step's draft (drafting.proposer.Draft, one row per scheduled sequence) without the tokens a request's
    grammar rejects: a chain cut at its first one, a tree without the nodes whose path it rejects. Nothing is
    spent verifying a token that could never be emitted."""
    from specserve.drafting.tree import Tree
    for i, seq in enumerate(seqs):
        tokens = draft.token_ids[i]
        if seq.grammar is None or not tokens:
            continue
        tree = draft.trees[i] if draft.trees is not None else None
        if tree is None:
            draft.token_ids[i] = tokens[:seq.grammar.valid_prefix(tokens)]
            continue
        paths = [[tokens[m] for m in torch.nonzero(tree.attn_mask[n]).view(-1).tolist()] for n in range(len(tokens))]
        keep = [n for n, path in enumerate(paths) if seq.grammar.valid_prefix(path) == len(path)]
        index = {n: j for j, n in enumerate(keep)}               # a kept node's parent is kept too: ancestors first
        parents = [index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in keep]
        draft.token_ids[i] = [tokens[n] for n in keep]
        draft.trees[i] = Tree.of(parents) if keep else None
        if draft.parents is not None:
            draft.parents[i] = None if draft.trees[i] is None else parents
    return draft
