"""Logprob.decoded_token: each logprob token's text on its own, as vLLM 0.26 names them
(vllm/tokenizers/detokenizer_utils.convert_ids_list_to_tokens, then the correction in
vllm/v1/engine/logprobs.py):

  - `tokenizer.decode([id])`, special tokens kept (decode's default), "" for None;
  - with a SentencePiece-style (Metaspace) pre-tokenizer, the leading spaces that decode() drops
    from a piece starting with the marker ("▁") are put back, so "▁true" and "true" differ;
  - a text ending in U+FFFD (part of a multi-byte character) is decoded again after the chosen
    tokens before it in the same sequence (prompt or output), at most 4: the shortest context
    that completes the character gives the text this token adds; with none, "".

Texts of single ids are cached (a vocabulary's worth at most); the U+FFFD correction depends on
the context and is not.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from pagedserve.logprobs import Logprob, PositionLogprobs, logprob_dict

_REPLACEMENT = "\ufffd"
_MAX_CONTEXT = 4  # enough for any UTF-8 character


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of the tokenizer's pre-tokenizer, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except Exception:
        return None
    for p in [pre] + list(pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []):
        if p.get("type") == "Metaspace":
            return p.get("replacement", "▁")
    return None


class LogprobTokens:
    """Names the tokens of logprob positions with one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._marker = _space_marker(tokenizer)
        self._alone: dict[int, str] = {}

    def alone(self, token_id: int) -> str:
        """The token decoded by itself (vLLM's convert_ids_list_to_tokens of one id)."""
        s = self._alone.get(token_id)
        if s is None:
            tok = self.tokenizer
            s = tok.decode([token_id]) or ""
            if self._marker is not None:
                raw = tok.convert_ids_to_tokens([token_id])[0] or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                missing = markers - (len(s) - len(s.lstrip(" ")))
                if markers and missing > 0:
                    s = " " * missing + s
            self._alone[token_id] = s
        return s

    def texts(self, token_ids: Iterable[int], context: list[int]) -> list[str]:
        """decoded_token of each id, all alternatives at one position; context: the chosen tokens
        before that position in the same sequence, oldest first."""
        ids = list(token_ids)
        out = [self.alone(t) for t in ids]
        for i, s in enumerate(out):
            if s.endswith(_REPLACEMENT):
                out[i] = self._completed(ids[i], context)
        return out

    def position(self, p: PositionLogprobs, context: list[int]) -> dict[int, Logprob]:
        return logprob_dict(p, self.texts(p.token_ids, context))

    def _completed(self, token_id: int, context: list[int]) -> str:
        """The text token_id adds after the shortest tail of context that completes its character:
        context tokens that are themselves pieces of it (their own text ends in U+FFFD) count as
        this token's, as vLLM's _correct_decoded_token attributes them."""
        decode = self.tokenizer.decode
        for n in range(1, min(len(context), _MAX_CONTEXT) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            clean = len(ctx)
            while clean > 0 and self.alone(ctx[clean - 1]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = decode(ctx[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0  # normalization changed the prefix: drop what the two share
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def prompt_positions(prompt_logprobs: list, prompt_ids: list[int],
                     names: LogprobTokens | None) -> list[dict[int, Logprob] | None]:
    """RequestOutput.prompt_logprobs from the engine's PositionLogprobs (None at position 0);
    a position's context is the prompt tokens before it from position 1 on (vLLM's: position
    0 has no entry to take its token from)."""
    out: list[dict[int, Logprob] | None] = []
    for i, p in enumerate(prompt_logprobs):
        if p is None:
            out.append(None)
        elif names is None:
            out.append(logprob_dict(p))
        else:
            out.append(names.position(p, prompt_ids[max(1, i - _MAX_CONTEXT):i]))
    return out


def output_position(p: PositionLogprobs, earlier: list[int], names: LogprobTokens | None) -> dict[int, Logprob]:
    """One generated position's dict; earlier: the sequence's output tokens before it."""
    if names is None:
        return logprob_dict(p)
    return names.position(p, earlier[-_MAX_CONTEXT:])
