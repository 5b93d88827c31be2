"""Tool calls in the Hermes convention of Qwen-family ChatML templates: the offered tools sit in the system prompt
as <tools>[...]</tools>, and each call the model makes is <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

A template that renders `tools` itself gets them; one that does not (SmolLM2's, the demo model's) gets the Hermes
system block, assistant tool calls as <tool_call> text and tool results as <tool_response> turns. tool_choice
"required" or a named function is a grammar (structured_output.py): the reply can only be such calls.
"""
from __future__ import annotations

import json
import re
import uuid

from specserve.server.errors import APIError
from specserve.structured_output import StructuredOutput

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


def chosen_tools(tools: list[dict], tool_choice) -> list[dict]:
    """The tools the model may call under tool_choice (none, auto, required or {"type": "function", ...})."""
    if tool_choice in (None, "auto", "required"):
        return tools
    if tool_choice == "none":
        return []
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    picked = [t for t in tools if t["function"]["name"] == name]
    if not picked:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return picked


def render_messages(messages: list[dict], tools: list[dict], template_has_tools: bool) -> list[dict]:
    """The conversation for a template that does not render tools: Hermes system block, calls and results as text."""
    if not tools or template_has_tools:
        return messages
    block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(call_dict(c))}\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content") or "", calls) if x)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def call_dict(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    return {"name": fn.get("name"), "arguments": json.loads(args) if isinstance(args, str) and args else args or {}}


MAX_PARALLEL_CALLS = 4


def call_grammar(tools: list[dict], parallel: bool = True) -> StructuredOutput:
    """<tool_call> blocks (one, or up to MAX_PARALLEL_CALLS with parallel tool calls), each naming one of `tools`
    with arguments that follow its parameters."""
    def schema(tool: dict) -> dict:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
    union = {"anyOf": [schema(t) for t in tools]} if len(tools) > 1 else schema(tools[0])
    union["x-guidance"] = {"whitespace_flexible": False}       # compact JSON, as for response formats
    more = f'("\\n" call)~0..{MAX_PARALLEL_CALLS - 1}' if parallel else ""
    return StructuredOutput(grammar=f'start: call {more}\ncall: "<tool_call>\\n" obj "\\n</tool_call>"\n'
                                    f"obj: %json {json.dumps(union)}")


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the content outside the calls, or None; OpenAI's tool_calls) from a reply. A block that is not a JSON
    object with a name stays in the content."""
    calls, kept, end = [], [], 0
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, args = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    rest = text[end:]
    if calls:                                  # a call cut off (max_tokens) is neither content nor a call
        rest = rest[:safe_prefix(rest)]
    content = ("".join(kept) + rest).strip() if calls else text
    return (content or None), calls


def safe_prefix(text: str) -> int:
    """How much of streamed text can be sent as content: all but a <tool_call> block or a partial opening tag."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
