"""vLLM's Logprob objects in offline outputs: logprob and rank against HF transformers' logits,
decoded_token as vLLM 0.26 names tokens, and the dict each position is (pagedserve/logprobs.py)."""
import pytest
import torch

from pagedserve import Logprob, SamplingParams
from pagedserve.logprobs import PositionLogprobs, logprob_dict

from logprob_reference import rank_band, vllm_name
from .helpers import PROMPT_TEXTS, hf_model, make_llm, tokenizer

TOL = 1e-4  # ours and HF's float32 logits differ by reduction order


def _hf_logp(model_dir, ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


def _check_position(d, chosen, ref, n_top, tok, context):
    """One position's dict against HF's log_softmax `ref` at that position."""
    assert list(d)[0] == chosen and all(isinstance(v, Logprob) for v in d.values())
    values, order = ref.sort(descending=True)
    assert set(d) == set(ref.topk(n_top).indices.tolist()) | {chosen}
    exact = True
    for t, lp in d.items():
        assert lp.logprob == pytest.approx(float(ref[t]), abs=TOL)
        # vLLM's rank: tokens with a logprob >= this one's (all of a tie), within our float noise
        lo, hi = rank_band(ref, t, TOL)
        assert lo <= lp.rank <= hi, (t, lp, lo, hi)
        exact &= lo == hi
        if t != chosen or lp.rank <= n_top:  # a top-N entry's rank is its place among them
            assert float(values[lp.rank - 1]) == pytest.approx(lp.logprob, abs=TOL)
        assert lp.decoded_token == (None if tok is None else vllm_name(tok, t, context))
    return exact


def test_sample_and_prompt_logprobs_match_hf(tiny_model_dir):
    """Greedy and sampled rows, top-N of 0, 3 and 5, and the prompt's logprobs with top 4: every
    logprob and rank HF's (rank: vLLM's >= count over the whole vocabulary), the chosen token
    first, decoded_token vLLM's (texts with multi-byte characters split across tokens)."""
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    # Multi-byte characters split across tokens, one of them at position 0 (named "" in vLLM: no
    # context comes before position 1's token), and a third prompt whose first token is ASCII.
    prompts = [tok.encode(PROMPT_TEXTS[3]), tok.encode(PROMPT_TEXTS[1]), tok.encode("Q: " + PROMPT_TEXTS[6])]
    llm = make_llm(model_dir, block_size=4)
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, prompt_logprobs=4),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=10, logprobs=5),
              SamplingParams(temperature=1.0, seed=11, max_tokens=10, logprobs=0, prompt_logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    exact = total = 0
    for p, sp, out in zip(prompts, params, outs):
        c = out.outputs[0]
        ref = _hf_logp(model_dir, p + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            # context: this sequence's chosen tokens before (never the prompt's), as vLLM's
            exact += _check_position(d, t, ref[len(p) - 1 + i], sp.logprobs, tok, c.token_ids[max(0, i - 4):i])
            total += 1
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            # vLLM's context for a prompt position: the prompt tokens before it from position 1 on
            exact += _check_position(out.prompt_logprobs[j], p[j], ref[j - 1], sp.prompt_logprobs, tok,
                                     p[max(1, j - 4):j])
            total += 1
    # The tolerance leaves a rank open only beside a near-tie: most are checked exactly.
    assert exact >= 0.9 * total, (exact, total)
    names = [d[t].decoded_token for t, d in zip(prompts[2][1:], outs[2].prompt_logprobs[1:])]
    assert "" in names and "".join(names) == tok.decode(prompts[2][1:])  # split characters named once, whole
    llm.shutdown()


def test_without_a_tokenizer_decoded_token_is_none(tiny_model_dir):
    """skip_tokenizer_init: the same logprobs and ranks, no names."""
    model_dir = tiny_model_dir("llama")
    ids = tokenizer(str(model_dir)).encode(PROMPT_TEXTS[0])
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1)
    named = make_llm(model_dir).generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    bare = make_llm(model_dir, skip_tokenizer_init=True).generate([{"prompt_token_ids": ids}], sp,
                                                                    use_tqdm=False)[0]
    named_lps = named.outputs[0].logprobs + named.prompt_logprobs[1:]
    bare_lps = bare.outputs[0].logprobs + bare.prompt_logprobs[1:]
    for a, b in zip(named_lps, bare_lps):
        assert list(a) == list(b)
        assert [(v.logprob, v.rank) for v in a.values()] == [(v.logprob, v.rank) for v in b.values()]
        assert all(v.decoded_token is None for v in b.values())
    assert all(isinstance(v.decoded_token, str) for d in named_lps for v in d.values())


def test_a_position_is_vllms_dict():
    """The chosen token first with its vocabulary rank, the top N after it ranked 1..N; a chosen
    token among them keeps its first place and takes its rank there (vLLM writes the key twice)."""
    outside = logprob_dict(PositionLogprobs([7, 5, 3], [-2.0, -0.5, -1.0], 6), ["a", "b", "c"])
    assert list(outside.items()) == [(7, Logprob(-2.0, 6, "a")), (5, Logprob(-0.5, 1, "b")),
                                     (3, Logprob(-1.0, 2, "c"))]
    inside = logprob_dict(PositionLogprobs([3, 5, 3], [-1.0, -0.5, -1.0], 3))
    assert list(inside.items()) == [(3, Logprob(-1.0, 2, None)), (5, Logprob(-0.5, 1, None))]
    assert logprob_dict(PositionLogprobs([4], [-0.1], 1)) == {4: Logprob(-0.1, 1, None)}


def test_sentencepiece_leading_spaces_are_kept():
    """A Metaspace (SentencePiece-style) tokenizer's decode() drops a leading "▁" of the first
    piece; vLLM puts the spaces back from the piece itself, so "▁true" and "true" differ."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.engine.logprob_tokens import LogprobTokens
    vocab = {"<unk>": 0, "▁true": 1, "true": 2, "▁▁x": 3, "x": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tok.decode([1]) == tok.decode([2]) == "true"  # what per-id decode alone gives
    names = LogprobTokens(tok)
    assert names.texts([1, 2, 3, 4], []) == [" true", "true", "  x", "x"]
    d = names.position(PositionLogprobs([2, 1], [-0.1, -2.0], 1), [])
    assert [v.decoded_token for v in d.values()] == ["true", " true"]
