"""Tokenizer, chat templates and incremental detokenization, checked against transformers on tiny local tokenizers."""
import json
import random
import threading
import time
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from specserve.tokenizer import IncrementalDetokenizer, Tokenizer, flatten_content

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|python_tag|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
]  # fmt: skip
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog. ",
    "def add(x: int, y: int) -> int:\n    return x + y\n",
    "日本語のテキストです。中文文本。",
    "emoji 😀🎉👍 party 🎉🎉",
]
TEXTS = [
    "Hello, world! The quick brown fox.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Party time 😀🎉👍🏽 and 👨‍👩‍👧 family",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "mixed: naïve café 日本 😀 end",
    "<|im_start|>user\nhi 😀<|im_end|>\n",
]

CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA31_TEMPLATE = """{{- bos_token }}

{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}

{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}

{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{# This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{# System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}

{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}

{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}

{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}

{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}

{{- system_message }}
{{- "<|eot_id|>" }}

{# Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {# Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}

    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}

    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}

    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}

    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}

        {%- set tool_call = message.tool_calls[0].function %}

        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}

        {%- if builtin_tools is defined %}
            {# This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}

    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}

{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# The date block of Llama 3.2 Instruct's template, which asks the renderer for today's date.
LLAMA32_DATE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- for message in messages %}
    {{- message['role'] + ': ' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle — 天气",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "user", "content": "Hi there! 😀"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "  Tell me about 日本.  "},
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds en français."}


def train_backend() -> BackendTokenizer:
    """A byte-level BPE with a tiny vocabulary, so CJK and emoji characters are split across several tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1", special_tokens=[("<|begin_of_text|>", bos_id)]
    )  # Llama 3 style: BOS comes from the post-processor
    return backend


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return train_backend().to_str()


def make_model_dir(root: Path, tokenizer_json: str, config: dict, generation_config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    return root


def added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True}  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> Path:
    eos = added_token("<|eot_id|>")  # the AddedToken-style dict form
    config = {"bos_token": "<|begin_of_text|>", "eos_token": eos, "chat_template": LLAMA31_TEMPLATE}
    generation_config = {"bos_token_id": 0, "eos_token_id": [1, 2, 5]}
    return make_model_dir(tmp_path_factory.mktemp("llama"), tokenizer_json, config, generation_config)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> Path:
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    return make_model_dir(tmp_path_factory.mktemp("chatml"), tokenizer_json, config, {"eos_token_id": 8})


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def hf(llama_dir: Path):
    return AutoTokenizer.from_pretrained(llama_dir)


# --- encode / decode / vocabulary ---


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf, text: str):
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ids[0] != tok.bos_token_id and tok.encode(text)[0] == tok.bos_token_id
    for skip_special_tokens in (True, False):
        assert tok.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)
        with_bos = tok.encode(text)
        assert tok.decode(with_bos, skip_special_tokens) == hf.decode(with_bos, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("call", ["encode", "decode"])
def test_a_long_text_leaves_other_threads_running(tok: Tokenizer, call: str):
    """The server tokenizes in a worker thread: that only frees its event loop if the GIL is released. Were it
    held for the whole call, one of this loop's 1 ms sleeps would last about as long as the call itself."""
    text = "the quick brown fox jumps over the lazy dog. " * 20_000           # ~0.9 MB
    args = (text,) if call == "encode" else (tok.encode(text),)
    results: list = []
    worker = threading.Thread(target=lambda: results.append(getattr(tok, call)(*args)))
    start = last = time.perf_counter()
    worker.start()
    gaps = []
    while worker.is_alive():
        time.sleep(0.001)
        gaps.append(time.perf_counter() - last)
        last = time.perf_counter()
    elapsed = time.perf_counter() - start
    assert results and len(gaps) >= 5 and max(gaps) < elapsed / 2, (len(gaps), max(gaps), elapsed)


def test_special_tokens_and_vocab(tok: Tokenizer, hf, chatml_dir: Path):
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.eos_token_id == hf.eos_token_id == 2
    assert tok.eos_token_ids == {1, 2, 5}  # generation_config's list plus the tokenizer's eos
    assert tok.pad_token_id is None and hf.pad_token_id is None
    assert tok.vocab_size == len(hf) == tok.backend.get_vocab_size() > 300
    assert tok.token_to_id("<|eot_id|>") == 2 and tok.id_to_token(2) == "<|eot_id|>"
    assert tok.token_to_id("not a token") is None
    assert set(hf.all_special_ids) <= set(tok.all_special_ids) == set(range(len(SPECIAL_TOKENS)))

    chatml = Tokenizer.from_pretrained(chatml_dir)
    chatml_hf = AutoTokenizer.from_pretrained(chatml_dir)
    assert chatml.bos_token_id is None and chatml_hf.bos_token_id is None
    assert chatml.pad_token_id == chatml_hf.pad_token_id == 9
    assert chatml.eos_token_ids == {8}  # int eos in generation_config, same as the tokenizer's
    text = "no bos here 😀"
    assert chatml.encode(text) == chatml_hf(text)["input_ids"]


def test_special_token_missing_from_vocab_is_added_like_transformers(tmp_path: Path, tokenizer_json: str):
    model_dir = make_model_dir(tmp_path, tokenizer_json, {"eos_token": "<|eot_id|>", "pad_token": "<pad>"})
    num_trained = BackendTokenizer.from_str(tokenizer_json).get_vocab_size()
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert tok.pad_token_id == hf.pad_token_id == num_trained
    assert tok.vocab_size == len(hf) == num_trained + 1
    assert tok.encode("a<pad>b") == hf("a<pad>b")["input_ids"]


def test_padding_and_truncation_in_tokenizer_json_do_not_apply(tmp_path: Path, tokenizer_json: str):
    backend = BackendTokenizer.from_str(tokenizer_json)
    backend.enable_padding(pad_id=9, pad_token="<|endoftext|>", length=64)
    backend.enable_truncation(max_length=8)
    model_dir = make_model_dir(tmp_path, backend.to_str(), {"eos_token": "<|eot_id|>"})
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert tok.pad_token_id == hf.pad_token_id == 9
    assert tok.encode(TEXTS[1]) == hf(TEXTS[1])["input_ids"] and len(tok.encode(TEXTS[1])) > 8


# --- chat templates ---


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template_dir", ["chatml_dir", "llama_dir"])
def test_chat_template_matches_transformers(request, template_dir, with_system, add_generation_prompt):
    model_dir = request.getfixturevalue(template_dir)
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = ([SYSTEM] if with_system else []) + CONVERSATION
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert expected.startswith("<|begin_of_text|>" if template_dir == "llama_dir" else "<|im_start|>system\n")


@pytest.mark.parametrize("template_dir", ["chatml_dir", "llama_dir"])
def test_chat_template_with_tools_matches_transformers(request, template_dir):
    model_dir = request.getfixturevalue(template_dir)
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}
    messages = [
        SYSTEM,
        {"role": "user", "content": "Weather in 東京?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "晴れ, 25°C"},
    ]
    for kwargs in ({}, {"tools_in_user_message": False, "date_string": "01 Jan 2042"}):
        expected = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, **kwargs)
        assert tok.apply_chat_template(messages, False, tools=[WEATHER_TOOL], **kwargs) == expected
        assert "Météo actuelle — 天气" in expected  # tojson keeps non-ASCII


def test_llama_date_string_and_strftime_now(tmp_path: Path, tokenizer_json: str, tok: Tokenizer):
    assert "Today Date: 01 Jan 2042\n\n" in tok.apply_chat_template(CONVERSATION, date_string="01 Jan 2042")
    config = {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA32_DATE_TEMPLATE}
    model_dir = make_model_dir(tmp_path, tokenizer_json, config)
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template(CONVERSATION)
    assert rendered == hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(f"<|begin_of_text|>Today Date: {datetime.now().strftime('%d %b %Y')}\n\n")


def test_chat_template_jinja_file_wins(tmp_path: Path, tokenizer_json: str):
    model_dir = make_model_dir(tmp_path, tokenizer_json, {"eos_token": "<|im_end|>", "chat_template": "config"})
    (model_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CONVERSATION) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_chat_template_list_takes_default_or_tool_use(tmp_path: Path, tokenizer_json: str):
    templates = [
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"},
    ]
    model_dir = make_model_dir(tmp_path, tokenizer_json, {"chat_template": templates})
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert tok.apply_chat_template(CONVERSATION[:1]) == "user=Hi there! 😀;"
    assert tok.apply_chat_template(CONVERSATION[:1], tools=[WEATHER_TOOL]) == "tools:1"
    for tools in (None, [WEATHER_TOOL]):
        assert tok.apply_chat_template(CONVERSATION, tools=tools) == hf.apply_chat_template(
            CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True
        )


def test_template_features_like_transformers(tmp_path: Path, tokenizer_json: str):
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.content | tojson(indent=2) }}]{% endgeneration %}{% endfor %}"
        "{{ ns.n }}{{ eos_token }}{% if m is defined %}{{ raise_exception('bad ' + m.role) }}{% endif %}"
    )
    model_dir = make_model_dir(tmp_path, tokenizer_json, {"eos_token": "<|eot_id|>", "chat_template": template})
    tok, hf = Tokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = CONVERSATION + [{"role": "user", "content": {"nested": ["ü"]}}]
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert tok.apply_chat_template(messages) == expected == '["Hi there! 😀"]["Hello! How can I help?"]2<|eot_id|>'
    with pytest.raises(jinja2.TemplateError, match="bad user"):
        tok.apply_chat_template(messages, m={"role": "user"})
    evil_dir = make_model_dir(tmp_path / "evil", tokenizer_json, {"chat_template": "{% set ns = namespace(_x=1) %}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_pretrained(evil_dir).apply_chat_template(messages)


def test_missing_chat_template_is_a_clear_error(tmp_path: Path, tokenizer_json: str):
    tok = Tokenizer.from_pretrained(make_model_dir(tmp_path, tokenizer_json, {}))
    with pytest.raises(ValueError, match="no default chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_flatten_content():
    assert flatten_content("plain") == "plain"
    assert flatten_content(None) == ""
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second 😀"}]
    assert flatten_content(parts) == "first\nsecond 😀"
    with pytest.raises(ValueError, match="image_url"):
        flatten_content([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}])


# --- incremental detokenization ---


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces, start, i = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        pieces.append(detok.add(ids[start : start + size]))
        assert len(detok.window) <= 2 * max(chunk_sizes) + 4  # only a few recent tokens are ever decoded
        start, i = start + size, i + 1
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def test_test_tokenizer_splits_characters(tok: Tokenizer):
    pieces = [tok.decode([i]) for i in tok.encode(TEXTS[2] + TEXTS[3], add_special_tokens=False)]
    assert sum("\ufffd" in piece for piece in pieces) >= 10
    # some token holds whole characters, or a character's end, together with the start of the next one
    assert any(piece.endswith("\ufffd") and len(piece) >= 2 for piece in pieces)


@pytest.mark.parametrize("text", TEXTS[2:5] + [TEXTS[0]])
def test_incremental_detokenizer_matches_decode(tok: Tokenizer, text: str):
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    rng = random.Random(0)
    for chunk_sizes in ([1], [2], [3], [5], [rng.randint(1, 6) for _ in range(20)]):
        pieces = stream(tok, ids, chunk_sizes)
        assert "".join(pieces) == expected
        assert all("\ufffd" not in piece for piece in pieces)  # never half a character
        assert pieces[-1] == ""  # valid text: nothing left for flush


def test_incremental_detokenizer_with_prompt_context(tok: Tokenizer):
    prompt_ids = tok.encode("Say something in 日本語:")
    ids = tok.encode(" こんにちは 😀 world", add_special_tokens=False)
    for chunk_sizes in ([1], [4]):
        assert "".join(stream(tok, ids, chunk_sizes, prompt_ids=prompt_ids)) == tok.decode(ids)


def test_incremental_detokenizer_special_tokens(tok: Tokenizer):
    ids = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n日本 😀<|eot_id|>", add_special_tokens=False)
    for skip in (True, False):
        for chunk_sizes in ([1], [3]):
            text = "".join(stream(tok, ids, chunk_sizes, skip_special_tokens=skip))
            assert text == tok.decode(ids, skip_special_tokens=skip)
            assert ("<|eot_id|>" in text) != skip


def test_text_before_an_incomplete_character_is_not_held_back(tok: Tokenizer):
    ids = tok.encode("and 👨‍👩‍👧 family", add_special_tokens=False)
    first_partial = next(k for k, i in enumerate(ids) if tok.decode([i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[: first_partial + 1]) == tok.decode(ids[:first_partial]) == "and"
    assert detok.text + "".join(detok.add([i]) for i in ids[first_partial + 1 :]) == tok.decode(ids)


def test_flush_emits_incomplete_tail_like_decode(tok: Tokenizer):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    truncated = ids[:-1]  # the emoji's last byte never arrives
    assert tok.decode(truncated).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in truncated)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(truncated)
    assert detok.text == tok.decode(truncated)
