"""Incremental detokenization against the tokenizer's own full decode."""
import pytest

from pagedserve.engine.detokenizer import detokenize_incrementally, initial_state
from pagedserve.engine.detokenizer import find_stop_string
from pagedserve.logprobs import PositionLogprobs

TEXTS = [
    "Héllo wörld! Ünïcödé text, 日本語のテキスト, emoji 🚀🔥 and ΕΛΛΗΝΙΚΑ letters.",
    "Привет, мир! Как дела? Всё хорошо. 🚀🚀🔥",
    "def main():\n    print('hello, world')\n    return 0\n",
    "日本語🔥Привет",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_models import train_tokenizer
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def _stream(tokenizer, prompt, output, skip_special_tokens=True):
    state = initial_state(len(prompt))
    pieces = []
    for i in range(1, len(output) + 1):
        new, state = detokenize_incrementally(tokenizer, prompt, output[:i], state, skip_special_tokens)
        pieces.append(new)
    new, state = detokenize_incrementally(tokenizer, prompt, output, state, skip_special_tokens, final=True)
    pieces.append(new)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", [0, 3, 7])
def test_stream_equals_full_decode_without_replacement_chars(tokenizer, text, split):
    ids = tokenizer.encode(text)
    # The test must exercise tokens that end mid-character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids) or text.isascii()
    # Split at a character boundary: the output's own text is then well defined.
    while split and tokenizer.decode(ids[:split]).endswith("\ufffd"):
        split += 1
    prompt, output = ids[:split] or tokenizer.encode("A"), ids[split:]
    pieces = _stream(tokenizer, prompt, output)
    assert "".join(pieces) == tokenizer.decode(output)
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    out = tokenizer.encode("Привет") + [eos] + tokenizer.encode(" 🚀")
    prompt = tokenizer.encode("Hi")
    assert "".join(_stream(tokenizer, prompt, out)) == tokenizer.decode(out, skip_special_tokens=True)
    kept = "".join(_stream(tokenizer, prompt, out, skip_special_tokens=False))
    assert kept == tokenizer.decode(out, skip_special_tokens=False)
    assert tokenizer.eos_token in kept


def test_incomplete_tail_is_held_until_final(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1
    prompt = tokenizer.encode("x")
    state = initial_state(len(prompt))
    new, state2 = detokenize_incrementally(tokenizer, prompt, ids[:1], state)
    assert new == "" and state2 == state
    new, _ = detokenize_incrementally(tokenizer, prompt, ids[:1], state, final=True)
    assert new == tokenizer.decode(ids[:1])


def test_find_stop_string_earliest_and_only_new_region():
    assert find_stop_string("hello world", ["wor", "lo"], 0) == (3, "lo")
    assert find_stop_string("hello world", ["lo"], 6) is None       # already checked before
    assert find_stop_string("hello world", ["o w"], 5) == (4, "o w")  # straddles the boundary


@pytest.mark.parametrize("finish", ["length", "stop"])
@pytest.mark.parametrize("text", TEXTS)
def test_request_text_gives_the_same_text_for_any_chunking_of_the_tokens(tokenizer, text, finish):
    """The API server joins a request's tokens that queued up (AsyncLLMEngine._catch_up; also
    speculative decoding's several tokens a step): without stop strings their text is decoded
    once a chunk. Every chunking streams what one token at a time does, and that is the
    tokenizer's own decode of the whole output less an EOS that ended it with "stop"."""
    import random

    from pagedserve.engine.text_output import RequestText
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams
    ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if finish == "stop" else [])
    prompt = tokenizer.encode("Q:")
    # special tokens kept: the EOS's text is left out by the finish rule alone
    params = SamplingParams(max_tokens=len(ids), logprobs=0, output_kind=RequestOutputKind.DELTA,
                            skip_special_tokens=False)

    def run(sizes):
        rt, pieces, at = RequestText(tokenizer, params, "Q:", prompt), [], 0
        for n in sizes:
            chunk, at = ids[at:at + n], at + n
            end = at == len(ids)
            c = CompletionOutput(0, "", chunk, -0.5 * at, [PositionLogprobs([t], [-0.5], 1) for t in chunk],
                                 finish if end else None, tokenizer.eos_token_id if end and finish == "stop" else None)
            o = rt.process(RequestOutput("r", "Q:", prompt, [c], end))
            if o is not None:
                pieces.append(o.outputs[0])
        # each token's decoded_token too: a chunk names its tokens after the same earlier ones
        return ("".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids],
                [lp[t].decoded_token for p in pieces for t, lp in zip(p.token_ids, p.logprobs)],
                pieces[-1].finish_reason, pieces[-1].cumulative_logprob)

    one_by_one = run([1] * len(ids))
    visible = ids[:-1] if finish == "stop" else ids
    assert one_by_one[0] == tokenizer.decode(visible, skip_special_tokens=False) and one_by_one[1] == ids \
        and one_by_one[3:] == (finish, -0.5 * len(ids)) and len(one_by_one[2]) == len(ids)
    rng = random.Random(len(text))
    for _ in range(5):
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.randint(1, 6)))
            left -= sizes[-1]
        assert run(sizes) == one_by_one, sizes
    assert run([len(ids)]) == one_by_one


def test_a_stop_string_inside_a_chunk_keeps_the_cumulative_logprob_of_the_kept_tokens(tokenizer):
    """Several tokens in one core output (a speculative step's accepted run): a stop string met on
    one of them ends the request there, and its cumulative logprob sums the kept tokens' logprobs
    only, not the run-on tokens' (the core's value at the chunk's end), as token by token."""
    from pagedserve.engine.text_output import RequestText
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams
    ids = tokenizer.encode("the cat sat on the mat and then it ran away")
    prompt = tokenizer.encode("Q:")
    lps = [-0.1 * (j + 1) for j in range(len(ids))]  # every token its own, so a wrong sum shows

    def run(sizes):
        params = SamplingParams(max_tokens=len(ids), logprobs=0, stop=["mat"],
                                output_kind=RequestOutputKind.DELTA)
        rt, out, at = RequestText(tokenizer, params, "Q:", prompt), None, 0
        for n in sizes:
            chunk, at = ids[at:at + n], at + n
            c = CompletionOutput(0, "", chunk, sum(lps[:at]),
                                 [PositionLogprobs([t], [lps[at - n + j]], 1) for j, t in enumerate(chunk)])
            out = rt.process(RequestOutput("r", "Q:", prompt, [c], False)) or out
            if rt.finished:
                break
        o = out.outputs[0]
        return o.finish_reason, o.stop_reason, len(rt.seqs[0].token_ids), o.cumulative_logprob

    one_by_one = run([1] * len(ids))
    kept = one_by_one[2]
    assert one_by_one[:2] == ("stop", "mat") and kept < len(ids) - 2
    assert one_by_one[3] == pytest.approx(sum(lps[:kept]))
    for sizes in ([len(ids)], [2] * len(ids), [kept - 1, len(ids)]):
        assert run(sizes) == pytest.approx(one_by_one), sizes


def test_a_stop_string_inside_a_run_without_logprobs_reports_no_cumulative_logprob(tokenizer):
    """A speculative step's accepted run carries no logprobs (speculating requests ask for none):
    a stop string met inside it cannot take the run-on tokens' logprobs off the core's cumulative
    value, so the request reports None (vLLM's value without logprobs), not that sum; a cut on a
    run's last token, and every cut token by token, keep the exact value."""
    from pagedserve.engine.text_output import RequestText
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams
    ids = tokenizer.encode("the cat sat on the mat and then it ran away")
    prompt = tokenizer.encode("Q:")
    lps = [-0.1 * (j + 1) for j in range(len(ids))]

    def run(sizes):
        params = SamplingParams(max_tokens=len(ids), stop=["mat"], output_kind=RequestOutputKind.DELTA)
        rt, out, at = RequestText(tokenizer, params, "Q:", prompt), None, 0
        for n in sizes:
            chunk, at = ids[at:at + n], at + n
            c = CompletionOutput(0, "", chunk, sum(lps[:at]), None)
            out = rt.process(RequestOutput("r", "Q:", prompt, [c], False)) or out
            if rt.finished:
                break
        o = out.outputs[0]
        assert o.logprobs is None
        return o.finish_reason, o.stop_reason, len(rt.seqs[0].token_ids), o.cumulative_logprob

    one_by_one = run([1] * len(ids))
    kept = one_by_one[2]
    assert one_by_one[:2] == ("stop", "mat") and kept < len(ids) - 2
    assert one_by_one[3] == pytest.approx(sum(lps[:kept]))
    assert run([kept - 1, 1, len(ids)]) == pytest.approx(one_by_one)  # the cut on a run's last token
    assert run([len(ids)]) == one_by_one[:3] + (None,)
    assert run([kept - 1, len(ids)]) == one_by_one[:3] + (None,)
