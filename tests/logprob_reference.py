"""References the logprob tests share (tests/engine, tests/server)."""
from __future__ import annotations


def vllm_name(tok, token_id, context):
    """vLLM 0.26's decoded_token for a byte-level tokenizer, transcribed from its
    convert_ids_list_to_tokens and LogprobsProcessor._correct_decoded_token: the id decoded
    alone; if that ends in U+FFFD, the text it adds after the shortest of the last 1..4 context
    tokens that completes it (context pieces that are themselves partial count as its own)."""
    alone = tok.decode([token_id])
    if not alone.endswith("\ufffd"):
        return alone
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = tok.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        while clean and tok.decode([ctx[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        prefix = tok.decode(ctx[:clean]) if clean else ""
        assert full.startswith(prefix)  # no normalization in this tokenizer
        return full[len(prefix):]
    return ""


def rank_band(ref, token_id: int, tol: float) -> tuple[int, int]:
    """vLLM's rank of token_id under the log_softmax `ref` (tokens with a logprob >= its own,
    every tied one included) as the bounds float noise of `tol` leaves open: equal bounds
    unless another token is within tol of it."""
    v = ref[token_id]
    return int((ref > v + tol).sum()) + 1, int((ref >= v - tol).sum())
