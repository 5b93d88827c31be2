"""Committing sampled tokens: one at a time, with every stop condition checked after each, so a stop
inside an accepted speculative run cuts the output exactly where plain decoding would have stopped."""
from __future__ import annotations

from specserve.runtime.sequence import Sequence
from specserve.tokenizer import IncrementalDetokenizer


def append_tokens(seq: Sequence, new: list[int], detok: IncrementalDetokenizer, eos_token_ids: set[int],
                  max_model_len: int) -> tuple[list[int], str]:
    """Append `new` to seq, setting finish_reason and stop_reason when a stop hits. Returns the tokens
    appended and the text to emit now, holding back what may be the start of a stop string."""
    params, eos = seq.params, eos_token_ids
    appended: list[int] = []
    for token in new:
        seq.token_ids.append(token)
        appended.append(token)
        piece = detok.add([token])
        if params.stop and piece:
            start = max(0, len(seq.output_text) - max(map(len, params.stop)) + 1)
            seq.output_text += piece
            hits = [(seq.output_text.find(stop, start), stop) for stop in params.stop]
            hits = [(pos, stop) for pos, stop in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                seq.output_text = seq.output_text[:pos]
                seq.finish_reason, seq.stop_reason = "stop", stop
                break
        else:
            seq.output_text += piece
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            break
        if not params.ignore_eos and token in eos:
            seq.finish_reason, seq.stop_reason = "stop", None
            break
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
            break
        if len(seq) >= max_model_len:
            seq.finish_reason = "length"
            break
    if seq.finish_reason is not None and not isinstance(seq.stop_reason, str):
        seq.output_text += detok.flush()
    new_text = seq.output_text[seq.num_emitted_chars:]
    if params.stop and seq.finish_reason is None:   # hold back what may begin a stop string
        hold = max(map(len, params.stop)) - 1
        new_text = new_text[:max(0, len(new_text) - hold)]
    seq.num_emitted_chars += len(new_text)
    return appended, new_text
