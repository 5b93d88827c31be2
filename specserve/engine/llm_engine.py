"""The engine loop, the same for every drafting method: schedule, propose, verify, accept, postprocess."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig, MAX_NUM_ASSISTANT_TOKENS, SpecDefaults
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.sequence import Sequence, SequenceStatus, SpecStats
from specserve.layers.sampler import compute_probs, position_uniforms, sample_from_probs
from specserve.models.config import ModelConfig
from specserve.models.registry import load_model, parse_dtype
from specserve.sampling_params import SamplingParams
from specserve.spec.factory import build_proposer
from specserve.spec.proposer import Draft, TargetHidden
from specserve.spec.tree import Tree, accept_tree
from specserve.spec.verify import verify_greedy, verify_rejection
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftOf:
    """One sequence's draft in one step: its tokens, q rows when sampled, its tree when not a chain."""
    token_ids: list[int]
    probs: torch.Tensor | None = None      # [k, V]
    tree: Tree | None = None


class RequestError(ValueError):
    """A request the engine cannot serve (bad settings, a prompt that can never fit)."""


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    seq: Sequence


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return parse_dtype(config.torch_dtype or "bfloat16")
        return torch.float32
    return parse_dtype(dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.model = load_model(config.model, self.dtype, self.device, self.model_config)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.spec_defaults = SpecDefaults.from_generation_config(config.model)
        for name in SpecDefaults.__slots__:
            if getattr(config, name) is not None:
                setattr(self.spec_defaults, name, getattr(config, name))
        self.proposer, self.spec_method, drafter_bytes_per_token = build_proposer(config, self)
        mc = self.model_config
        target_bytes = kv_cache_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.dtype)
        bytes_per_block = (target_bytes + drafter_bytes_per_token) * config.block_size
        num_blocks = int(config.kv_cache_memory_gb * (1 << 30)) // bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds fewer than 2 blocks")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                  num_blocks, config.block_size, self.dtype, self.device)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        if self.proposer is not None:
            self.proposer.bind(self)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_num_tokens = num_blocks * config.block_size
        # a sequence never outgrows the whole KV cache (else it could never be scheduled again)
        self.max_model_len = min(self.max_model_len, self.max_num_tokens - 1)
        self.requests: dict[str, Sequence] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.stats = SpecStats()
        logger.info("model %s (%s, %s on %s), %d KV blocks of %d tokens, speculative method: %s",
                    config.model, mc.architectures[0], self.dtype, self.device, num_blocks, config.block_size,
                    self.spec_method)

    # ---- requests ---------------------------------------------------------------------------
    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fill the request's unset speculative fields from the defaults, and check them."""
        d = self.spec_defaults
        for name in SpecDefaults.__slots__:
            if getattr(params, name) is None:
                setattr(params, name, getattr(d, name))
        if params.prompt_lookup_max < params.prompt_lookup_min:
            raise RequestError(f"prompt_lookup_max ({params.prompt_lookup_max}) must be >= "
                               f"prompt_lookup_min ({params.prompt_lookup_min})")
        if params.num_assistant_tokens > MAX_NUM_ASSISTANT_TOKENS:
            raise RequestError(f"num_assistant_tokens must be <= {MAX_NUM_ASSISTANT_TOKENS}, "
                               f"got {params.num_assistant_tokens}")
        if params.tree_depth > 0:
            if self.proposer is None or not self.proposer.supports_tree:
                raise RequestError(f"tree drafting (tree_depth={params.tree_depth}) needs a drafter that "
                                   f"drafts trees (eagle3); this server drafts with {self.spec_method!r}")
            b, depth, k = params.branching_factor, params.tree_depth, params.num_assistant_tokens
            if b * b * (depth - 1) + b < k:
                raise RequestError(f"a tree with branching_factor={b} and tree_depth={depth} has "
                                   f"{b * b * (depth - 1) + b} nodes, fewer than num_assistant_tokens={k}")
        return params

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        params = self.resolve(params)
        limit = min(self.max_model_len, self.max_num_tokens)
        if len(prompt_token_ids) >= limit:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; this model accepts at most "
                               f"{limit - 1} (max_model_len {self.max_model_len}, KV cache {self.max_num_tokens} tokens)")
        if bad := [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]:
            raise RequestError(f"prompt token ids out of the vocabulary: {bad[:5]}")
        seq = Sequence(prompt_token_ids, params, request_id)
        if seq.request_id in self.requests:
            raise RequestError(f"duplicate request id {seq.request_id!r}")
        seq.num_assistant_tokens = params.num_assistant_tokens if self.proposer is not None else 0
        if seq.seed is None:
            seq.seed = int(torch.randint(0, 2**62, (), generator=self.default_generator))
        seq.arrival_time = time.perf_counter()
        self.requests[seq.request_id] = seq
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.on_finished(seq)
        self.requests.pop(seq.request_id, None)
        self.detokenizers.pop(seq.seq_id, None)
        self.stats.merge(seq.spec)

    # ---- the loop ---------------------------------------------------------------------------
    def _lookahead(self, seq: Sequence) -> int:
        k = seq.num_assistant_tokens
        if k <= 0:
            return 0
        room = self.max_model_len - len(seq) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(k, room))

    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule(self._lookahead)
        if not scheduled:
            return []
        draft = self.propose(scheduled)
        items = self.prepare(scheduled, draft)
        hidden, aux = self.runner.forward(items, self.proposer.aux_layers if self.proposer else ())
        tokens, committed_rows = self.verify(scheduled, draft, hidden)
        outputs = self.postprocess(scheduled, draft, tokens)
        if self.proposer is not None:
            self.proposer.on_target_forward([s.seq for s in scheduled], TargetHidden(hidden, aux, committed_rows))
        for s in scheduled:
            self._register(s.seq)
        return outputs

    def propose(self, scheduled: list[ScheduledSeq]) -> dict[int, DraftOf]:
        """Each drafted sequence's draft, by its index in scheduled."""
        wants = [i for i, s in enumerate(scheduled) if s.lookahead > 0]
        if not wants:
            return {}
        draft: Draft = self.proposer.propose([scheduled[i].seq for i in wants],
                                             [scheduled[i].lookahead for i in wants], None)
        out = {}
        for j, i in enumerate(wants):
            ids = list(draft.token_ids[j][:scheduled[i].lookahead])
            if not ids:
                continue
            q = draft.probs[j, :len(ids)] if draft.probs is not None else None
            tree = None
            if draft.parents is not None and draft.parents[j] is not None:
                parents = draft.parents[j][:len(ids)]
                if parents != list(range(-1, len(ids) - 1)):       # a chain needs no tree
                    tree = Tree(parents)
            out[i] = DraftOf(ids, q, tree)
        return out

    def prepare(self, scheduled: list[ScheduledSeq], draft: dict[int, DraftOf]) -> list[ForwardItem]:
        items = []
        for i, s in enumerate(scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            ids = seq.token_ids[start:start + s.num_new]
            d = draft.get(i)
            if d is None:
                items.append(ForwardItem(seq.block_table, start, ids))
            elif d.tree is None:
                items.append(ForwardItem(seq.block_table, start, ids + d.token_ids))
            else:   # the last token, then the nodes: positions by depth, each node sees its ancestors
                n = len(d.token_ids)
                mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
                mask[:, 0] = True
                mask[1:, 1:] = d.tree.attn_mask
                positions = [start] + (start + d.tree.depth).tolist()
                items.append(ForwardItem(seq.block_table, start, ids + d.token_ids, positions, mask))
        return items

    def verify(self, scheduled: list[ScheduledSeq], draft: dict[int, DraftOf], hidden: torch.Tensor):
        """Target logits at the sampling rows -> committed tokens per scheduled sequence (None: mid-prompt)
        and the rows of hidden whose tokens were committed."""
        sample_idx, rows, offset, row_offsets = [], [], 0, []
        for i, s in enumerate(scheduled):
            n = s.num_new + (len(draft[i].token_ids) if i in draft else 0)
            row_offsets.append(offset)
            if s.completes_prompt:
                sample_idx.append(i)
                rows.append(list(range(offset + s.num_new - 1, offset + n)))
            offset += n
        tokens: list[list[int] | None] = [None] * len(scheduled)
        paths: dict[int, list[int]] = {}
        if sample_idx:
            B, K = len(sample_idx), max(len(r) for r in rows) - 1
            pad = torch.tensor([r + [r[-1]] * (K + 1 - len(r)) for r in rows], device=hidden.device)  # [B, K+1]
            logits = self.model.compute_logits(hidden[pad.view(-1)])                                  # [B*(K+1), V]
            seqs = [scheduled[i].seq for i in sample_idx]
            drafts = [draft.get(i) for i in sample_idx]
            if all(seq.params.greedy for seq in seqs):
                y = logits.view(B, K + 1, -1).argmax(dim=-1).cpu()                                   # [B, K+1]
                p = None
            else:
                p = compute_probs(logits, *self._sampling_tensors(seqs, K + 1, logits.device)).view(B, K + 1, -1).cpu()
                # the uniform of a row is the one of the sequence position its token would take
                depth = [d.tree.depth.tolist() if d is not None and d.tree is not None else list(range(1, K + 1))
                         for d in drafts]
                positions = [[len(seq)] + [len(seq) + x for x in dep] + [len(seq)] * (K - len(dep))
                             for seq, dep in zip(seqs, depth)]
                u = position_uniforms([seq.seed for seq in seqs], positions)                          # [B, K+1]
                y = sample_from_probs(p.view(B * (K + 1), -1), u.view(-1)).view(B, K + 1)
            chain = [b for b, d in enumerate(drafts) if d is None or d.tree is None]
            sampled_q = [b for b in chain if drafts[b] is not None and drafts[b].probs is not None and p is not None]
            if chain:
                draft_tokens = torch.tensor([(drafts[b].token_ids if drafts[b] else []) + [0] * (K - len(rows[b]) + 1)
                                             for b in chain], dtype=torch.int64).view(len(chain), K)
                num_draft = torch.tensor([len(rows[b]) - 1 for b in chain])
                out, num = verify_greedy(y[chain], draft_tokens, num_draft)
                if sampled_q:   # drafts sampled from q: the rejection rule (Leviathan et al.) on those rows
                    sub = [chain.index(b) for b in sampled_q]
                    q = torch.zeros(len(sampled_q), K, p.shape[-1])
                    for r, b in enumerate(sampled_q):
                        q[r, :len(drafts[b].token_ids)] = drafts[b].probs[:, :p.shape[-1]].cpu()
                    seeds = [seqs[b].seed for b in sampled_q]
                    starts = [[len(seqs[b]) + j for j in range(K + 1)] for b in sampled_q]
                    u_accept = position_uniforms(seeds, [s[:K] for s in starts], stream=1)
                    u_sample = position_uniforms(seeds, starts)
                    out_q, num_q = verify_rejection(p[sampled_q], draft_tokens[sub], num_draft[sub], q, u_accept, u_sample)
                    out[sub], num[sub] = out_q, num_q
                out, num = out.tolist(), num.tolist()
                for r, b in enumerate(chain):
                    tokens[sample_idx[b]] = out[r][:num[r]]
            for b, d in enumerate(drafts):
                if d is not None and d.tree is not None:
                    n = len(d.token_ids)
                    accepted, final = accept_tree(y[b:b + 1, :n + 1], d.tree, torch.tensor([d.token_ids]))
                    path = accepted[0].nonzero().squeeze(1).tolist()
                    tokens[sample_idx[b]] = [d.token_ids[j] for j in path] + [int(final[0])]
                    paths[sample_idx[b]] = path
        committed = []
        for i, s in enumerate(scheduled):
            base = row_offsets[i]
            if i in paths:   # tree: the last token, then the accepted path's nodes
                committed.append(list(range(base, base + s.num_new)) + [base + s.num_new + j for j in paths[i]])
                self._compact_path(s.seq, s.seq.num_computed_tokens + s.num_new, paths[i])
            else:
                num_valid = s.num_new + (len(tokens[i]) - 1 if tokens[i] else 0)
                committed.append(list(range(base, base + num_valid)))
        return tokens, committed

    def _compact_path(self, seq: Sequence, first_node: int, path: list[int]) -> None:
        """Move the accepted nodes' K/V from their tree slots to consecutive ones; the other branches'
        entries are left behind, past the sequence's length, to be overwritten."""
        src = [first_node + j for j in path]
        dst = list(range(first_node, first_node + len(path)))
        if src != dst:
            self.runner.move_kv(seq.block_table, src, dst)

    def _sampling_tensors(self, seqs: list[Sequence], rows_each: int, device) -> tuple[torch.Tensor, ...]:
        temperature = torch.tensor([seq.params.temperature for seq in seqs]).repeat_interleave(rows_each)
        top_k = torch.tensor([seq.params.top_k for seq in seqs]).repeat_interleave(rows_each)
        top_p = torch.tensor([seq.params.top_p for seq in seqs]).repeat_interleave(rows_each)
        return temperature.to(device), top_k.to(device), top_p.to(device)

    def postprocess(self, scheduled: list[ScheduledSeq], draft: dict, tokens: list[list[int] | None]) -> list[StepOutput]:
        outputs = []
        now = time.perf_counter()
        for i, s in enumerate(scheduled):
            seq, new = s.seq, tokens[i]
            if new is None:                    # a prompt chunk: nothing sampled yet
                seq.num_computed_tokens += s.num_new
                continue
            num_draft = len(draft[i].token_ids) if i in draft else 0
            seq.spec.num_target_forwards += 1
            seq.spec.record(num_draft, len(new) - 1)
            seq.num_computed_tokens += s.num_new + len(new) - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            appended, text = self._append(seq, new)
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, appended, text, seq.finish_reason is not None, seq))
        return outputs

    def _append(self, seq: Sequence, new: list[int]) -> tuple[list[int], str]:
        """Append tokens one at a time, stopping exactly where plain decoding would have stopped."""
        params, eos = seq.params, self.tokenizer.eos_token_ids
        detok = self.detokenizers[seq.seq_id]
        appended: list[int] = []
        for token in new:
            seq.token_ids.append(token)
            appended.append(token)
            piece = detok.add([token])
            if params.stop and piece:
                start = max(0, len(seq.output_text) - max(map(len, params.stop)) + 1)
                seq.output_text += piece
                hits = [(seq.output_text.find(stop, start), stop) for stop in params.stop]
                hits = [(pos, stop) for pos, stop in hits if pos >= 0]
                if hits:
                    pos, stop = min(hits)
                    seq.output_text = seq.output_text[:pos]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    break
            else:
                seq.output_text += piece
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                break
            if not params.ignore_eos and token in eos:
                seq.finish_reason, seq.stop_reason = "stop", None
                break
            if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
                seq.finish_reason = "length"
                break
            if len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
                break
        if seq.finish_reason is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += detok.flush()
        new_text = seq.output_text[seq.num_emitted_chars:]
        if params.stop and seq.finish_reason is None:   # hold back what may begin a stop string
            hold = max(map(len, params.stop)) - 1
            new_text = new_text[:max(0, len(new_text) - hold)]
        seq.num_emitted_chars += len(new_text)
        return appended, new_text

    def _register(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        valid = seq.num_computed_tokens
        if self.proposer is not None and self.proposer.uses_kv_cache:
            valid = min(valid, seq.num_drafter_computed)
        self.block_manager.register(seq, valid)
