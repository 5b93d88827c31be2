"""What every route reads: the engine facade, the served names, the sampling defaults, and prompt building (run in
worker threads: templating and tokenizing a large prompt takes seconds)."""
from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.async_engine import AsyncEngine
from specserve.server.errors import APIError
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import ChatCompletionRequest, SamplingDefaults, TokenizeRequest, check_text
from specserve.server.token_text import TokenText
from specserve.server.tools import render_messages
from specserve.tokenizer import flatten_content


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None
    metrics: ServerMetrics
    sampling_defaults: SamplingDefaults
    token_text: TokenText

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(self.served_model_names)}", param="model")
        return self.served_model_names[0]

    # run in a worker thread (tokenizing or templating a large prompt takes seconds), never on the event loop
    def chat_prompt_ids(self, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None = None
                        ) -> list[int]:
        """tools: the ones offered (a template that does not render tools gets them the Hermes way, tools.py)."""
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": flatten_content(m.content)}
                        for m in body.messages]
            template_has_tools = bool(tools) and "tools" in self.tokenizer.get_chat_template(tools)
            messages = render_messages(messages, tools or [], template_has_tools)
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                        tools=tools if template_has_tools else None,
                                                        **(body.chat_template_kwargs or {}))
        except Exception as e:              # template errors (raise_exception, bad parts) are the request's
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        return self.tokenizer.encode(check_text(prompt, "messages"), add_special_tokens=False)

    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=add_special_tokens)
