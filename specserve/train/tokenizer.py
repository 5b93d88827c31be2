"""A byte-level BPE tokenizer with ChatML special tokens, saved in the Hugging Face layout."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]      # ids 0, 1, 2

# Qwen2's split: single digits, words with one leading non-letter, runs of newlines, indentation kept apart
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """CHAT_TEMPLATE in Python (the tests check that both agree)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,          # every training document starts after <|endoftext|>
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
