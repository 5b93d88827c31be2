"""The tokenizer rebuilt from a GGUF file gives the ids transformers' own GGUF tokenizer gives
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), for each supported pre-tokenizer, on SmolLM2's real
49,152-token vocabulary."""
from __future__ import annotations

import shutil

import gguf
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gguf_files import CONTROL, USER_DEFINED, F, write_gguf
from specserve.config import default_model_file
from specserve.gguf.convert import converted_dir
from specserve.tokenizer import Tokenizer
from test_gguf import checkpoint

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fibonacci(n - 1) + fibonacci(n-2)  # recurse\n",
    "class Stack:\n    def __init__(self):\n        self.items: list[int] = []\n\n\n\n    def push(self, x): ...",
    "   leading spaces,  two  spaces,    four, and trailing   ",
    "\n\n\nnewlines\r\n\r\nand tabs\t\t\tand a mix \t \n  \n",
    "Unicode: naïve café, Straße, 日本語のテキスト, emoji 🚀🔥👩‍💻, Ελληνικά, العربية, ﬁ ligature, \u00a0nbsp",
    "digits 1234567890 3.14159 2024-12-01 x=42 1,000,000 0xFF 12abc34",
    "It's we're they'll I'd you've DON'T SHOUTING'S",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|><|endoftext|>",
    "text<|im_end|>glued<|im_start|> and <repo_name>",
    "",
]


def smollm2_tokenizer_fields(reader: gguf.GGUFReader) -> dict:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    return {"tokens": tokens, "types": types, "merges": reader.fields["tokenizer.ggml.merges"].contents()}


# SmolLM2 has no token of two digits; these make the pre-tokenizers' digit rules visible:
# "1234" is [12, 34] when the digits stay together (gpt2), [123, 4] in runs of three (llama-bpe), 1 2 3 4 one by one
DIGIT_TOKENS, DIGIT_MERGES = ["12", "34", "123"], ["1 2", "3 4", "12 3"]


@pytest.fixture(scope="module")
def smollm2_vocab() -> dict:
    fields = smollm2_tokenizer_fields(gguf.GGUFReader(default_model_file()))
    return {"tokens": fields["tokens"] + DIGIT_TOKENS, "types": fields["types"] + [1] * len(DIGIT_TOKENS),
            "merges": fields["merges"] + DIGIT_MERGES}


def assert_same_ids(folder, gguf_path):
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"], text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_smollm2_file_itself(tmp_path):
    """pre-tokenizer `smollm`: digits one by one, then GPT-2's split."""
    path = tmp_path / default_model_file().name
    shutil.copyfile(default_model_file(), path)      # transformers reads a folder + file name
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert_same_ids(converted_dir(default_model_file()), path)


def write_vocab_gguf(tmp_path, vocab: dict, pre: str, add_bos: bool | None):
    """A tiny llama model carrying the given vocabulary (its embedding has a row per token)."""
    hf = checkpoint(tmp_path / "hf", "llama", hidden=32, heads=2, kv_heads=1, tie=True)
    n = len(vocab["tokens"])
    (hf / "config.json").write_text((hf / "config.json").read_text().replace('"vocab_size": 400', f'"vocab_size": {n}'))
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.embed_tokens.weight"] = torch.randn(n, 32) * 0.02
    save_file(weights, str(hf / "model.safetensors"))
    path, _ = write_gguf(hf, tmp_path / "m.gguf", "llama", F.F16, tokenizer=vocab, pre=pre, eos=2, bos=1,
                         add_bos=add_bos)
    return path


@pytest.mark.parametrize("pre,add_bos,digits", [("gpt2", None, ["12", "34"]), ("llama-bpe", True, ["123", "4"]),
                                                ("qwen2", False, ["1", "2", "3", "4"])])
def test_each_pre_tokenizer_on_a_real_vocabulary(tmp_path, smollm2_vocab, pre, add_bos, digits):
    """SmolLM2's vocabulary and merges under another pre-tokenizer; one control token made user-defined
    (matched whole, but ordinary text), and BOS added where the file asks for it."""
    vocab = dict(smollm2_vocab, types=list(smollm2_vocab["types"]))
    assert vocab["types"][3] == CONTROL          # <repo_name>
    vocab["types"][3] = USER_DEFINED
    path = write_vocab_gguf(tmp_path, vocab, pre, add_bos)
    folder = converted_dir(path)
    assert_same_ids(folder, path)
    ours = Tokenizer.from_pretrained(folder)
    assert ours.encode("<repo_name>", add_special_tokens=False) == [3]
    assert ours.decode([3, 1, 2]) == "<repo_name>"              # user-defined: kept; control: skipped
    assert (ours.encode("hi")[0] == 1) == bool(add_bos)
    pieces = [ours.id_to_token(i) for i in ours.encode("1234", add_special_tokens=False)]
    assert pieces == digits


def test_smollm_pre_tokenizer_splits_digits_one_by_one(tmp_path, smollm2_vocab):
    """llama.cpp's `smollm` (and SmolLM2's own tokenizer.json): each digit alone, whatever the merges.
    transformers reads `smollm` as plain GPT-2, which only SmolLM2's digit-free vocabulary makes equal."""
    ours = Tokenizer.from_pretrained(converted_dir(write_vocab_gguf(tmp_path, smollm2_vocab, "smollm", None)))
    assert [ours.id_to_token(i) for i in ours.encode("x 1234", add_special_tokens=False)] == [
        "x", "Ġ", "1", "2", "3", "4"]
