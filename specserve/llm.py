"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import copy
import time
from dataclasses import fields

from specserve.config import EngineConfig
from specserve.drafting.factory import all_options
from specserve.drafting.options import spellings
from specserve.engine.llm_engine import LLMEngine
from specserve.runtime.sequence import Sequence
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import normalize_messages


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """model: a Hugging Face folder or a GGUF file (converted once, cached); None: SmolLM2-135M-Instruct.
        kwargs are EngineConfig fields (dtype, speculative_method, draft_model, num_assistant_tokens, ...) and
        the drafting methods' options (tree_depth=2: the engine-wide default, as the same flag of `serve`)."""
        names, options = {f.name for f in fields(EngineConfig)}, spellings(all_options())
        if unknown := sorted(set(kwargs) - names - set(options)):
            raise TypeError(f"unknown LLM options: {unknown}")
        draft_options = {name: kwargs.pop(name) for name in list(kwargs) if name in options and name not in names}
        if draft_options:
            kwargs["draft_options"] = {**kwargs.get("draft_options", {}), **draft_options}
        config = EngineConfig(**kwargs) if model is None else EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        seqs, texts = [], []
        for prompt, p in zip(prompts, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            texts.append(prompt if isinstance(prompt, str) else None)
            seqs.append(self.engine.add_request(ids, _copy(p or SamplingParams())))
        return self._run(seqs, texts)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(normalize_messages(c), add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs) for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        seqs = [self.engine.add_request(i, _copy(sampling_params or SamplingParams())) for i in ids]
        return self._run(seqs, prompts)

    def _run(self, seqs: list[Sequence], prompts: list[str | None]) -> list[RequestOutput]:
        last_time: dict[int, float] = {}
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                last_time[out.seq.seq_id] = now
        return [to_request_output(seq, prompt, last_time.get(seq.seq_id)) for seq, prompt in zip(seqs, prompts)]


def _copy(params: SamplingParams) -> SamplingParams:
    """A copy the engine may resolve in place (one SamplingParams may serve many prompts)."""
    return copy.deepcopy(params)


def to_request_output(seq: Sequence, prompt: str | None, last_time: float | None) -> RequestOutput:
    ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
    decode = last_time - seq.first_token_time if seq.first_token_time and last_time else None
    return RequestOutput(
        request_id=seq.request_id, prompt=prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
        outputs=[CompletionOutput(0, seq.output_text, seq.output_token_ids, seq.finish_reason, seq.stop_reason)],
        finished=seq.is_finished, spec=seq.spec.to_dict(), ttft_s=ttft, decode_s=decode)
