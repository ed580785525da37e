"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions.

The request becomes one BeamSearchParams per prompt, as vLLM's to_beam_search_params makes it:
n is the beam width; max_tokens (chat: max_completion_tokens, else max_tokens) as for
sampling; temperature the request's, else the generation config's, else 1.0; ignore_eos and
length_penalty as given. include_stop_str_in_output and skip_special_tokens shape the output
(text_output.beam_search_output). The search runs in the engine core like any other request
(LLMEngine.add_beam_search_request): the same hypotheses as LLM.beam_search, HF's
num_beams=n, early_stopping=True (engine/beam_search.py), not vLLM's own front-end loop.

The response holds n choices per prompt, best first, each with finish_reason "stop" (EOS) or
"length"; usage counts every choice's tokens, EOS only with include_stop_str_in_output.
logprobs (completions) and logprobs / top_logprobs (chat) are honoured as vLLM's server honours
them, and written as for a sampled request: each token's raw logprob (the value its beam's score
summed) and the top k of the step that produced it (BeamSearchParams.logprobs carries k, bounded
by --max-logprobs as for sampling).

Refused, each a 400 naming its field:
- stream on /v1/completions, in vLLM's words (vLLM refuses it there; on chat, as in vLLM, the
  stream carries the finished search at once: each choice's role, then each choice whole, one
  choice a chunk);
- a field a beam search cannot honour, set to anything but its no-op value (vLLM drops these
  without a word; pagedserve drops nothing silently): the sampling knobs, stop strings and
  ids, token biases and bans, prompt_logprobs, best_of other than n, max_tokens 0;
- echo with logprobs on /v1/completions: it needs the prompt's logprobs, which a search does
  not compute (nor does vLLM's, which returns none);
- length_penalty other than 1 without use_beam_search (it means nothing to sampling).
structured_outputs / response_format / tools constrain every beam (BeamSearchParams'
structured_outputs); seed is accepted: a beam search draws nothing, its result is the same
for every seed.
"""
from __future__ import annotations

from typing import Any

from pagedserve.entrypoints.openai.serving_common import APIError
from pagedserve.sampling_params import BeamSearchParams, StructuredOutputsParams

# Accepted only at these values (None, unset, always): {field: no-op values}.
_NOT_FOR_BEAMS: dict[str, tuple] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
    "min_tokens": (0,), "stop": ([], ""), "stop_token_ids": ([],),
    "logit_bias": ({},), "bad_words": ([],), "allowed_token_ids": (),
    "prompt_logprobs": (), "repetition_detection": (),
    # vLLM's beam search decodes each text whole, without it: refused rather than dropped
    "spaces_between_special_tokens": (True,),
}

STREAM_REFUSED = "Streaming is not currently supported with beam search"  # vLLM's words


def check_beam_search(req: Any, max_num_seqs: int, chat: bool) -> bool:
    """Whether req asks for a beam search; raises APIError for a combination it cannot serve."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1.0):
            raise APIError("length_penalty applies to beam search only (use_beam_search)",
                           param="length_penalty")
        return False
    if req.stream and not chat:
        raise APIError(STREAM_REFUSED, param="use_beam_search")
    for name, noops in _NOT_FOR_BEAMS.items():
        value = getattr(req, name, None)
        if value is not None and not any(value == ok for ok in noops):
            raise APIError(f"{name} is not supported with use_beam_search", param=name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise APIError(f"best_of is not supported with use_beam_search: n ({req.n}) is the beam width, "
                       f"got best_of {best_of}", param="best_of")
    if not chat and req.echo and req.logprobs is not None:
        raise APIError("echo with logprobs is not supported with use_beam_search: the search computes "
                       "no prompt logprobs", param="echo")
    if getattr(req, "max_tokens", None) == 0:
        raise APIError("max_tokens must be >= 1 with use_beam_search", param="max_tokens")
    if req.n > max_num_seqs:
        raise APIError(f"n (the beam width) must be <= {max_num_seqs} with use_beam_search (the server's "
                       f"--max-num-seqs: every beam runs at once), got {req.n}", param="n")
    return True


def beam_search_params(req: Any, max_tokens: int, default_sampling: dict,
                       structured: StructuredOutputsParams | None, logprobs: int | None = None) -> BeamSearchParams:
    """logprobs: the top tokens the response shows per position (checked against --max-logprobs,
    -1 resolved); None: no logprobs cross from the engine core."""
    temperature = req.temperature if req.temperature is not None else default_sampling.get("temperature", 1.0)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=temperature,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                structured_outputs=structured, logprobs=logprobs)
    except ValueError as e:
        raise APIError.from_value_error(e, fields=("temperature", "length_penalty", "max_tokens")) from None
