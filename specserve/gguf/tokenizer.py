"""The tokenizer a GGUF file describes, rebuilt as Hugging Face files: tokenizer.json and tokenizer_config.json.

A GGUF holds a byte-level BPE vocabulary and its merges as metadata, and names its pre-tokenizer (how text is
split before the merges apply) in `tokenizer.ggml.pre`; each name below is llama.cpp's split for that name.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from specserve.gguf.reader import GGUFFile

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    """use_regex: GPT-2's own split; else the text was split already."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level(False)])


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges: a piece that is a whole token stays one, as llama.cpp does)
PRE_TOKENIZERS = {
    "gpt2": (lambda: byte_level(True), False),
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level(True)]),
               False),
    "llama-bpe": (lambda: split_then_bytes(LLAMA3_SPLIT), True),
    "llama3": (lambda: split_then_bytes(LLAMA3_SPLIT), True),
    "qwen2": (lambda: split_then_bytes(QWEN2_SPLIT), False),
}


def token_id(file: GGUFFile, name: str) -> int | None:
    value = file.field(f"tokenizer.ggml.{name}_token_id", None)
    return None if value is None else int(value)


def build_tokenizer(file: GGUFFile) -> Tokenizer:
    model = file.field("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{file.path}: unsupported GGUF tokenizer model {model!r} (supported: gpt2, byte-level BPE)")
    pre = file.field("tokenizer.ggml.pre", None)      # older files: llama.cpp guesses a split; we do not
    if pre is None:
        raise ValueError(f"{file.path}: the GGUF file names no pre-tokenizer (tokenizer.ggml.pre), so how its text "
                         f"is split is unknown (supported: {', '.join(PRE_TOKENIZERS)})")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{file.path}: unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    make_pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = file.field("tokenizer.ggml.tokens")
    types = file.field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in file.field("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{file.path}: the GGUF vocabulary repeats tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = make_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>) are special: matched whole in text, dropped by skip_special_tokens;
    # user-defined ones (<think>) are matched whole but are ordinary text
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    tokenizer.post_processor = post_processor(file, tokens)
    return tokenizer


def post_processor(file: GGUFFile, tokens: list[str]) -> processors.TemplateProcessing:
    """BOS and EOS added around a text when the file asks for them (tokenizer.ggml.add_bos_token / add_eos_token)."""
    first, last, specials = [], [], []
    for name, where in (("bos", first), ("eos", last)):
        tid = token_id(file, name)
        if tid is not None and file.field(f"tokenizer.ggml.add_{name}_token", False):
            where.append(tokens[tid])
            specials.append((tokens[tid], tid))
    single = [*first, "$A", *last]
    pair = [*first, "$A", *last, *first, "$B:1", *last]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


def tokenizer_config(file: GGUFFile) -> dict:
    """tokenizer_config.json: the named special tokens, the BOS/EOS flags and the chat template stored in the file."""
    tokens = file.field("tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(file.hparam("context_length")),
              "add_bos_token": bool(file.field("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(file.field("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        tid = token_id(file, key)
        if tid is not None:
            config[name] = tokens[tid]
    template = file.field("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def generation_config(file: GGUFFile) -> dict:
    """generation_config.json: BOS, and every id that ends a turn (EOS, and Llama 3's end-of-turn tokens)."""
    eos = [tid for tid in (token_id(file, "eos"), token_id(file, "eot"), token_id(file, "eom")) if tid is not None]
    config = {"bos_token_id": token_id(file, "bos"), "eos_token_id": list(dict.fromkeys(eos)) if len(set(eos)) > 1
              else (eos[0] if eos else None)}
    if token_id(file, "padding") is not None:
        config["pad_token_id"] = token_id(file, "padding")
    return config
