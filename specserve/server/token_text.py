"""Token ids as OpenAI's logprobs show them: each token's text and its UTF-8 bytes."""
from __future__ import annotations

import functools

from specserve.tokenizer import Tokenizer


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


class TokenText:
    """token id -> (text, bytes), cached. A byte-level BPE token that ends inside a UTF-8 character has no text of
    its own ("\ufffd" decoded); its bytes are the raw ones, as OpenAI reports them."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self.of = functools.lru_cache(maxsize=1 << 16)(self._of)

    def _of(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.id_to_token(token_id)
        table = byte_decoder()
        if self.byte_level and piece is not None and all(c in table for c in piece):
            return text, [table[c] for c in piece]
        return text, list(text.encode("utf-8"))
