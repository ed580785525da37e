"""SamplingParams.detokenize (vLLM's, default True): False gives token ids with text "" and
Logprob.decoded_token None (sampled and prompt logprobs), the same tokens and logprob values as
True; stop strings are refused at construction with vLLM's words. Offline (LLM) and in the API
server's front end (RequestText, which AsyncLLMEngine users reach)."""
import pytest

from pagedserve import SamplingParams
from pagedserve.engine.text_output import RequestText
from pagedserve.logprobs import PositionLogprobs
from pagedserve.outputs import CompletionOutput, RequestOutput

from .helpers import hf_greedy, make_llm, tokenizer


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["x"], detokenize=False)
    assert str(e.value) == ("stop strings are only supported when detokenize is True. "
                            "Set detokenize=True to use stop.")
    assert SamplingParams().detokenize is True
    SamplingParams(stop_token_ids=[5], detokenize=False)  # token stops need no text


def test_llm_without_detokenize_gives_ids_and_no_text(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    prompt = tok.encode("日本語🔥 and more")
    llm = make_llm(model_dir)
    kw = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    on, off = llm.generate([{"prompt_token_ids": prompt}] * 2,
                           [SamplingParams(**kw), SamplingParams(**kw, detokenize=False)])
    ref = hf_greedy(model_dir, prompt, 8, ignore_eos=True)
    assert list(on.outputs[0].token_ids) == list(off.outputs[0].token_ids) == ref
    assert on.outputs[0].text == tok.decode(ref) and off.outputs[0].text == ""
    for a, b in zip(on.outputs[0].logprobs, off.outputs[0].logprobs):
        assert list(a) == list(b) and all(a[t].logprob == b[t].logprob for t in a)
        assert all(v.decoded_token is None for v in b.values())
        assert all(v.decoded_token is not None for v in a.values())
    assert off.prompt_logprobs[0] is None and on.prompt_logprobs[1:] and off.prompt_logprobs[1:]
    for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:]):
        assert [v.logprob for v in a.values()] == [v.logprob for v in b.values()]
        assert all(v.decoded_token is None for v in b.values())
        assert all(v.decoded_token is not None for v in a.values())


@pytest.mark.parametrize("detokenize", [True, False])
def test_server_front_end_honours_detokenize(tiny_model_dir, detokenize):
    tok = tokenizer(str(tiny_model_dir("llama")))
    prompt, out_ids = tok.encode("Q:"), tok.encode("日本語🔥")
    params = SamplingParams(max_tokens=len(out_ids), logprobs=0, detokenize=detokenize)
    rt = RequestText(tok, params, "Q:", prompt)
    final = None
    for k, t in enumerate(out_ids):  # the core's token-only DELTA outputs, one token a step
        end = k == len(out_ids) - 1
        c = CompletionOutput(0, "", [t], -0.5 * (k + 1), [PositionLogprobs([t], [-0.5], 1)],
                             "length" if end else None)
        final = rt.process(RequestOutput("r", "Q:", prompt, [c], end)) or final
    got = final.outputs[0]
    assert list(got.token_ids) == out_ids
    assert got.text == (tok.decode(out_ids) if detokenize else "")
    names = [d[t].decoded_token for d, t in zip(got.logprobs, out_ids)]
    assert (None not in names) if detokenize else names == [None] * len(out_ids)
