"""One streamed request to an OpenAI-compatible server, timed chunk by chunk, plus the server's spec counters."""
import codecs
import json
import re
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

SPEC_COUNTER_PREFIX = "vllm:spec_decode_"
POSITION_LABEL = re.compile(r'position="(\d+)"')


@dataclass(slots=True)
class RequestInput:
    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    chat: bool = False                  # True: /v1/chat/completions with the prompt as the user message
    temperature: float | None = None
    ignore_eos: bool = False
    extra_body: dict | None = None


@dataclass(slots=True)
class RequestFuncOutput:
    """One benchmark request's outcome (vLLM's name; the offline API's result is specserve.outputs.RequestOutput).
    Times are `time.perf_counter()` seconds. A content chunk is a chunk whose choice carries text."""
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0              # from the final usage chunk
    generated_text: str = ""
    start_time: float = 0.0
    ttft: float = 0.0                   # start -> first content chunk
    latency: float = 0.0                # start -> last content chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    usage: dict = field(default_factory=dict)
    num_content_chunks: int = 0
    last_content_time: float = 0.0
    last_chunk_time: float = 0.0        # any chunk with choices, the fallback when no chunk carried text

    def add_event(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if error := chunk.get("error"):
            self.error = json.dumps(error)
            return
        if usage := chunk.get("usage"):
            self.usage = usage
            self.output_tokens = usage.get("completion_tokens") or 0
            if usage.get("prompt_tokens") is not None:
                self.prompt_len = usage["prompt_tokens"]
        if not (choices := chunk.get("choices")):
            return
        self.last_chunk_time = now
        text = choice_text(choices[0])
        if not text:
            return
        if self.num_content_chunks == 0:
            self.ttft = now - self.start_time
        else:
            self.itl.append(now - self.last_content_time)
        self.last_content_time = now
        self.latency = now - self.start_time
        self.num_content_chunks += 1
        self.generated_text += text

    def finish(self) -> None:
        saw_choices = self.last_chunk_time > 0
        if self.num_content_chunks == 0 and saw_choices:  # e.g. EOS first: the only chunk has no text
            self.ttft = self.latency = self.last_chunk_time - self.start_time
        self.success = not self.error and saw_choices
        if not self.success and not self.error:
            self.error = "the stream carried no choices"


def choice_text(choice: dict) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    return choice.get("text") or ""


class SSEDecoder:
    """Server-sent events from raw bytes: returns each complete event's `data` payload."""

    def __init__(self):
        self.buffer = ""
        self.utf8 = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes) -> list[str]:
        self.buffer = (self.buffer + self.utf8.decode(data)).replace("\r\n", "\n")  # a CR may end the last read
        *events, self.buffer = self.buffer.split("\n\n")
        return [p for p in map(event_data, events) if p is not None]

    def flush(self) -> list[str]:
        payload, self.buffer = event_data(self.buffer + self.utf8.decode(b"", final=True)), ""
        return [payload] if payload is not None else []


def event_data(event: str) -> str | None:
    lines = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
    return "\n".join(lines) if lines else None


def build_payload(req: RequestInput) -> dict:
    payload: dict = {"model": req.model, "stream": True, "stream_options": {"include_usage": True}}
    if req.chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
        payload["max_tokens"] = req.output_len      # servers that predate max_completion_tokens
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.output_len
    if req.temperature is not None:
        payload["temperature"] = req.temperature
    if req.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(req.extra_body or {})
    return payload


async def send_request(client: httpx.AsyncClient, req: RequestInput, pbar: tqdm | None = None) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    out.start_time = time.perf_counter()
    try:
        async with client.stream("POST", req.api_url, json=build_payload(req)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                decoder = SSEDecoder()
                async for data in response.aiter_bytes():
                    now = time.perf_counter()
                    for payload in decoder.feed(data):
                        out.add_event(payload, now)
                for payload in decoder.flush():
                    out.add_event(payload, time.perf_counter())
                out.finish()
    except Exception as e:  # one broken response fails its request, not the whole run (as in vLLM)
        out.error = f"{type(e).__name__}: {e}"
    if pbar is not None:
        pbar.update(1)
    return out


async def first_model(client: httpx.AsyncClient, base_url: str) -> tuple[str, str | None]:
    """The id of the first entry of /v1/models and its `root` (the path it was loaded from), if given."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models")
    return models[0]["id"], models[0].get("root")


@dataclass(slots=True)
class SpecCounters:
    """Cumulative `vllm:spec_decode_*_total` counters, summed over label sets other than position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)


def parse_spec_counters(text: str) -> SpecCounters | None:
    counters, found = SpecCounters(), False
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith(SPEC_COUNTER_PREFIX):
            continue
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        value = float(line[line.rfind("}") + 1:].split()[0] if "}" in line else line.split()[1])
        metric = name.removeprefix(SPEC_COUNTER_PREFIX)
        if metric == "num_drafts_total":
            counters.num_drafts += int(value)
        elif metric == "num_draft_tokens_total":
            counters.num_draft_tokens += int(value)
        elif metric == "num_accepted_tokens_total":
            counters.num_accepted_tokens += int(value)
        elif metric == "num_accepted_tokens_per_pos_total" and (m := POSITION_LABEL.search(line)):
            pos = int(m.group(1))
            counters.accepted_per_pos[pos] = counters.accepted_per_pos.get(pos, 0) + int(value)
        else:
            continue
        found = True
    return counters if found else None


async def fetch_spec_counters(client: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    """None when the server has no /metrics or no speculative counters (plain decoding, other servers)."""
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return parse_spec_counters(response.text) if response.status_code == 200 else None
