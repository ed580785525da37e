"""Logprobs as vLLM's server writes them: each token's name, the top entries of a position,
prompt_logprobs' JSON, and -inf as a number. A mixin of OpenAIServing (serving_common.py), which
gives it `engine` (its tokenizer) and `_token_str_cache`."""
from __future__ import annotations

from pagedserve.entrypoints.openai.protocol import PromptLogprob, TopLogprob
from pagedserve.logprobs import Logprob


class LogprobNames:
    def token_str(self, token_id: int, as_id: bool = False) -> str:
        """A token's text decoded by itself; as_id (return_tokens_as_token_ids): "token_id:N", as
        vLLM. What vLLM names a token with where its Logprob carries no decoded_token."""
        if as_id:
            return f"token_id:{token_id}"
        s = self._token_str_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            # Without a tokenizer (--skip-tokenizer-init) a token is named by its id, as vLLM does.
            s = f"token_id:{token_id}" if tok is None else tok.decode([token_id])
            if len(self._token_str_cache) < 1_000_000:
                self._token_str_cache[token_id] = s
        return s

    def token_name(self, token_id: int, entry: Logprob | None, as_id: bool = False) -> str:
        """A logprob token's name as vLLM's server writes it (_get_decoded_token): its Logprob's
        decoded_token where set (engine/logprob_tokens.py: SentencePiece leading spaces kept, a
        split character's bytes given to the token that completes it), else the id decoded alone."""
        if not as_id and entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.token_str(token_id, as_id)

    @staticmethod
    def top_entries(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The k most likely of a position's entries. Ties go by rank: the top-N in their order,
        then a chosen token from outside them (rank > N)."""
        ranked = sorted(lp.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0))
        return ranked[:k]

    def top_logprobs_chat(self, lp: dict[int, Logprob], k: int, as_ids: bool = False) -> list[TopLogprob]:
        out = []
        for t, v in self.top_entries(lp, k):
            s = self.token_name(t, v, as_ids)
            out.append(TopLogprob(token=s, logprob=_finite(v.logprob), bytes=_utf8(s)))
        return out


def _utf8(s: str) -> list[int]:
    """A name's bytes, as vLLM's (errors="replace": a name is text, never raises)."""
    return list(s.encode("utf-8", errors="replace"))


token_bytes = _utf8


def prompt_logprobs_json(lps: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's server writes them: each Logprob's fields, -inf
    as -9999.0 (vLLM's clamp_prompt_logprobs)."""
    if lps is None:
        return None
    return [None if d is None else {t: PromptLogprob(logprob=_finite(v.logprob), rank=v.rank,
                                                     decoded_token=v.decoded_token) for t, v in d.items()}
            for d in lps]


def _finite(x: float) -> float:
    """-inf is not JSON; OpenAI clients expect a number."""
    return x if x > -1e30 else -9999.0


finite_logprob = _finite
