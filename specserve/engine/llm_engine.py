"""The engine loop, the same for every drafting method: schedule, propose, verify, accept, postprocess."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from specserve.config import EngineConfig, GenerationConfig
from specserve.distributed.runner import ParallelRunner, ParallelTarget
from specserve.drafting.factory import engine_draft_defaults, proposer_class, resolve_method, resolve_request_options
from specserve.drafting.options import AUTO_MAX_DRAFT_TOKENS
from specserve.drafting.proposer import Draft, DrafterContext, Proposer, TargetHidden
from specserve.drafting.token_map import NO_TOKEN_MAP
from specserve.drafting.tree import path_moves
from specserve.engine.auto_draft import DraftPolicy, choose_draft_lengths, observe_step_time
from specserve.engine.block_manager import BlockManager
from specserve.engine.outputs import DraftGauges, RequestError, StepOutput  # noqa: F401 (re-exported)
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.stop_checker import append_tokens
from specserve.engine.verifier import Verified, verify_step
from specserve.models.config import ModelConfig
from specserve.models.registry import load_model
from specserve.runtime.device import configure_cpu, resolve_device, resolve_dtype
from specserve.runtime.model_runner import ForwardItem, ModelRunner, kv_cache_bytes_per_token
from specserve.runtime.sequence import Sequence, SpecStats
from specserve.sampling_params import SamplingParams
from specserve.structured_output import GrammarCompiler, cut_at_grammar
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        tp = config.tensor_parallel_size > 1          # the target sharded over ranks; the rest runs here, on rank 0
        self.model = ParallelTarget(config, self.model_config, self.device) if tp else \
            load_model(config.model, self.dtype, self.device, self.model_config)
        if self.device.type == "cpu":
            configure_cpu(config.num_threads, self.model, config.reserved_cpu_cores)
        self.model.pack(self.device, self.dtype, config.quantization, config.compile)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.generation_config = GenerationConfig.from_model_dir(config.model)
        self.spec_method, drafter_path = resolve_method(config, self.model_config)
        self.draft_defaults = engine_draft_defaults(self.spec_method, config, self.generation_config.values)
        proposer_cls = proposer_class(self.spec_method)
        if config.speculative_token_map not in (None, NO_TOKEN_MAP) and not proposer_cls.uses_token_map:
            raise ValueError(f"--speculative-token-map applies to the draft and mtp methods, not {self.spec_method}")
        mc = self.model_config
        ctx = DrafterContext(self.model, mc, self.tokenizer, Path(config.model), self.dtype, self.device,
                             config.block_size, 0, self.max_model_len, self.draft_defaults, config.ngram_cache,
                             config.speculative_token_map, config.quantization, config.speculative_catch_up_window)
        shape = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
        target_bytes = kv_cache_bytes_per_token(*shape, self.dtype, self.device, config.kv_cache_dtype)
        bytes_per_block = (target_bytes + proposer_cls.kv_bytes_per_token(drafter_path, ctx)) * config.block_size
        num_blocks = int(config.kv_cache_memory_gb * (1 << 30)) // bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds fewer than 2 blocks")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = (ParallelRunner if tp else ModelRunner)(self.model, *shape, num_blocks, config.block_size,
                                                              self.dtype, self.device, True, config.kv_cache_dtype)
        self.drafter_context = replace(ctx, num_blocks=num_blocks)
        self.proposer: Proposer = proposer_cls.create(drafter_path, self.drafter_context)
        if self.proposer.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, self.proposer.max_model_len)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.policy = DraftPolicy(AUTO_MAX_DRAFT_TOKENS)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size)
        self.draft_gauges = DraftGauges()
        if self.spec_method != "none" or config.compile:    # warm-up: first calls pack, allocate, and compile
            for rows in (1, 2) if config.compile else (1,):      # (one graph for one row, one for more)
                self.time_forward(rows)
        if self.spec_method != "none":
            self.policy.calibrate(self.time_forward, min(num_blocks * config.block_size, self.max_model_len))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_num_tokens = num_blocks * config.block_size
        self.max_model_len = min(self.max_model_len, self.max_num_tokens - 1)   # else it could never be scheduled
        self.requests: dict[str, Sequence] = {}
        self.parked: dict[str, list[Sequence]] = {}    # request id -> siblings waiting for its prompt (n > 1)
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.stats = SpecStats()
        logger.info("model %s (%s, %s on %s), %d KV blocks of %d tokens, speculative method: %s",
                    config.model, mc.architectures[0], self.dtype, self.device, num_blocks, config.block_size,
                    self.spec_method)

    # ---- requests ---------------------------------------------------------------------------
    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fill the request's unset drafting settings from the engine's, and check them (the drafting method
        checks what is its own: tree settings, its limits)."""
        try:
            resolve_request_options(params, self.spec_method, self.proposer, self.draft_defaults)
        except ValueError as e:
            raise RequestError(str(e)) from e
        return params

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    after: str | None = None) -> Sequence:
        """after: the id of a request with the same prompt (n > 1): this one waits until that one's prompt is
        computed, then finds its full blocks in the prefix cache instead of computing them again."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        params = self.resolve(params)
        limit = min(self.max_model_len, self.max_num_tokens)
        if len(prompt_token_ids) >= limit:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; this model accepts at most "
                               f"{limit - 1} (max_model_len {self.max_model_len}, KV cache {self.max_num_tokens} tokens)")
        vocab = self.model_config.vocab_size
        if bad := [t for t in prompt_token_ids if not 0 <= t < vocab]:
            raise RequestError(f"prompt token ids out of the vocabulary: {bad[:5]}")
        if bad := [t for t in params.logit_bias if not 0 <= t < vocab]:
            raise RequestError(f"logit_bias token ids out of the vocabulary (size {vocab}): {bad[:5]}")
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab]:
            raise RequestError(f"stop_token_ids out of the vocabulary (size {vocab}): {bad[:5]}")
        if params.top_k >= vocab:
            params.top_k = 0                   # keeps every token: the same as off, and fits the sampler's int64
        seq = Sequence(prompt_token_ids, params, request_id)
        if params.structured is not None:
            try:
                seq.grammar = self.grammars.matcher(params.structured)
            except ValueError as e:
                raise RequestError(str(e)) from e
        if seq.request_id in self.requests:
            raise RequestError(f"duplicate request id {seq.request_id!r}")
        seq.num_assistant_tokens = self.proposer.max_draft_tokens(params)
        if seq.seed is None:
            seq.seed = int(torch.randint(0, 2**62, (), generator=self.default_generator))
        seq.arrival_time = time.perf_counter()
        self.requests[seq.request_id] = seq
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        parent = self.requests.get(after) if after is not None else None
        if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
            self.parked.setdefault(parent.request_id, []).append(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def _unpark(self, request_id: str) -> None:
        for seq in self.parked.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.proposer.on_finished(seq)
        self.policy.forget(seq.seq_id)
        self._unpark(seq.request_id)
        self.requests.pop(seq.request_id, None)
        self.detokenizers.pop(seq.seq_id, None)
        self.stats.merge(seq.spec)

    # ---- the loop ---------------------------------------------------------------------------
    def _num_draft_tokens(self, seq: Sequence) -> int:
        room = self.max_model_len - len(seq) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return self.proposer.draftable(seq, k) if (k := max(0, min(seq.num_assistant_tokens, room))) else 0

    def step(self) -> list[StepOutput]:
        choose = functools.partial(choose_draft_lengths, self.policy, catch_up=self.proposer.catch_up_tokens)
        scheduled = self.scheduler.schedule(self._num_draft_tokens, choose)
        if not scheduled:
            return []
        try:
            return self.run_step(scheduled)
        except Exception as e:    # a defect, or a request admission let through: only this step's requests fail
            logger.exception("an engine step failed; finishing its %d requests with an error", len(scheduled))
            return self.fail_step(scheduled, e)

    def fail_step(self, scheduled: list[ScheduledSeq], error: Exception) -> list[StepOutput]:
        """Finish every sequence of a failed step (freeing its blocks) with an error output; the other
        requests are untouched: a step writes K/V only past its sequences' computed tokens."""
        message = f"internal error while generating ({type(error).__name__}: {error}); the request was stopped"
        outputs = []
        for s in scheduled:
            seq = s.seq
            if not seq.is_finished:            # those finished earlier in the step lost their last output too
                seq.finish_reason = "error"
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, [], "", True, seq.snapshot(), message))
        return outputs

    def run_step(self, scheduled: list[ScheduledSeq]) -> list[StepOutput]:
        catch_up = [self.proposer.catch_up_tokens(s.seq) for s in scheduled if s.num_draft_tokens > 0]
        start = time.perf_counter()
        draft = cut_at_grammar(self.propose(scheduled), [s.seq for s in scheduled])
        drafted = time.perf_counter()
        items = self.prepare(scheduled, draft)
        hidden, aux = self.runner.forward(items, self.proposer.aux_layers)
        verified = self.verify(scheduled, draft, hidden)
        observe_step_time(self.policy, scheduled, items, time.perf_counter() - drafted)
        outputs = self.postprocess(scheduled, draft, verified)
        self.draft_gauges.observe([s.num_draft_tokens for s in scheduled if s.num_new == 1])
        deferred = self.proposer.on_target_forward([s.seq for s in scheduled], TargetHidden(hidden, aux, verified.rows))
        self.policy.costs.observe_drafting(draft.token_ids, drafted - start, catch_up, deferred,
                                           self.proposer.catch_up_seconds)
        for s in scheduled:
            if not s.seq.is_finished:
                self._register(s.seq)
            if s.completes_prompt and s.seq.request_id in self.parked:   # its prompt's blocks are registered now
                self._unpark(s.seq.request_id)
        return outputs

    def time_forward(self, rows: int, slots: int = 1, chain: int = 1) -> float:
        """Seconds of one target forward and its logits at `rows` decode-shaped rows, in sequences of `chain` rows (a
        decode row and its draft's verify rows), a sequence's last row attending `slots` cache slots: the policy's
        calibration, before any request holds a block. Each sequence reads blocks of its own where there is room:
        sequences sharing one context read it from the CPU's caches (a slot then measured 0.0 us, not ~1)."""
        per_seq, num_blocks = -(-slots // self.block_manager.block_size), self.block_manager.num_blocks
        items = [ForwardItem([(r * per_seq + j) % num_blocks for j in range(per_seq)], slots - chain, [0] * chain)
                 for r in range(-(-rows // chain))]
        start = time.perf_counter()
        hidden, _ = self.runner.forward(items, self.proposer.aux_layers)
        self.model.compute_logits(hidden)
        return time.perf_counter() - start

    def propose(self, scheduled: list[ScheduledSeq]) -> Draft:
        """The step's draft: one row per scheduled sequence, empty where it drafts nothing."""
        wants = [i for i, s in enumerate(scheduled) if s.num_draft_tokens > 0]
        if not wants:
            return Draft.nothing(len(scheduled))
        limits = [scheduled[i].num_draft_tokens for i in wants]
        draft = self.proposer.propose([scheduled[i].seq for i in wants], limits)
        return draft.for_batch(wants, len(scheduled), limits)

    def prepare(self, scheduled: list[ScheduledSeq], draft: Draft) -> list[ForwardItem]:
        items = []
        for i, s in enumerate(scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            ids = seq.token_ids[start:start + s.num_new] + draft.token_ids[i]
            tree = draft.trees[i]
            if tree is None:
                items.append(ForwardItem(seq.block_table, start, ids))
            else:   # the last token, then the nodes: positions by depth, each node sees its ancestors
                items.append(ForwardItem(seq.block_table, start, ids, tree.positions(start), tree.forward_mask()))
        return items

    def verify(self, scheduled: list[ScheduledSeq], draft: Draft, hidden: torch.Tensor) -> Verified:
        verified = verify_step(scheduled, draft, hidden, self.model.compute_logits, self.tokenizer.eos_token_ids)
        for i, path in verified.paths.items():
            s = scheduled[i]
            if moves := path_moves(s.seq.num_computed_tokens + s.num_new, path):
                self.runner.move_kv(s.seq.block_table, *moves)
        return verified

    def postprocess(self, scheduled: list[ScheduledSeq], draft: Draft, verified: Verified) -> list[StepOutput]:
        tokens = verified.tokens
        outputs = []
        now = time.perf_counter()
        for i, s in enumerate(scheduled):
            seq, new = s.seq, tokens[i]
            if i in verified.prompt_logprobs:  # a recomputed prompt (preemption) reports each position once
                done = seq.num_computed_tokens + 1
                seq.prompt_logprobs.extend(verified.prompt_logprobs[i][len(seq.prompt_logprobs) + 1 - done:])
            if new is None:                    # a prompt chunk: nothing sampled yet
                seq.num_computed_tokens += s.num_new
                continue
            seq.spec.num_target_forwards += 1
            seq.spec.record(len(draft.token_ids[i]), len(new) - 1)
            if s.num_new == 1:                 # a decode step: what was chosen, and how it went
                seq.spec.draft_lengths.append(s.num_draft_tokens)
                self.policy.observe(seq.seq_id, len(draft.token_ids[i]), len(new) - 1)
            seq.num_computed_tokens += s.num_new + len(new) - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            appended, text = append_tokens(seq, new, self.detokenizers[seq.seq_id], self.tokenizer.eos_token_ids,
                                           self.max_model_len)
            logprobs = verified.logprobs.get(i, [])[:len(appended)]     # of the tokens kept (a stop cuts the rest)
            seq.logprobs.extend(logprobs)
            if seq.grammar is not None:
                seq.grammar.commit(appended)
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            if seq.finish_reason is not None:
                self._register(seq)           # before its blocks are freed: a max_tokens=1 request caches its prompt
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, appended, text, seq.finish_reason is not None, seq.snapshot(),
                                      new_logprobs=logprobs))
        return outputs

    def _register(self, seq: Sequence) -> None:
        valid = seq.num_computed_tokens
        self.block_manager.register(seq, valid, min(valid, seq.num_drafter_valid) if self.proposer.uses_kv_cache
                                    else valid)
