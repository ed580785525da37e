"""Sampling through the whole engine: logprobs vs HF, seeds, n > 1 forks, best_of."""
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.layers.sampler import derive_seed

from .helpers import assert_no_leak, hf_greedy, hf_model, make_llm, prompt_ids


def _hf_logprobs(model_dir, prompt, output):
    """log_softmax of HF's logits at each generated position."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_logprobs_match_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    ids = prompt_ids(model_dir)[:4]
    llm = make_llm(model_dir, block_size=4)
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=8, logprobs=5)] * 2
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for p, sp, out in zip(ids, params, outs):
        c = out.outputs[0]
        ref = _hf_logprobs(model_dir, p, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for pos, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lps[tok].logprob == pytest.approx(float(ref[pos, tok]), abs=1e-4)
            top = set(ref[pos].topk(sp.logprobs).indices.tolist())
            assert set(lps) == top | {tok}
            for t, lp in lps.items():
                assert lp.logprob == pytest.approx(float(ref[pos, t]), abs=1e-4)
            total += float(ref[pos, tok])
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert_no_leak(llm)


def test_top_k_1_sampling_is_greedy(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    ids = prompt_ids(model_dir)[:3]
    llm = make_llm(model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=1.5, top_k=1, max_tokens=8), use_tqdm=False)
    for p, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, p, 8)


def test_seeded_sampling_reproducible_and_batch_independent(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)
    llm = make_llm(model_dir, block_size=8)
    target = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = llm.generate({"prompt_token_ids": ids[1]}, target, use_tqdm=False)[0].outputs[0].token_ids
    # Same request inside a crowd of unseeded and differently-seeded requests, in another position.
    crowd = [{"prompt_token_ids": p} for p in ids]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=None if i % 2 else i) for i in range(len(ids))]
    params[4] = target
    crowd[4] = {"prompt_token_ids": ids[1]}
    outs = llm.generate(crowd, params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    # A different engine seed changes unseeded requests, never seeded ones.
    llm2 = make_llm(model_dir, block_size=16, seed=99)
    assert llm2.generate({"prompt_token_ids": ids[1]}, target, use_tqdm=False)[0].outputs[0].token_ids == alone
    # Synchronous steps draw the same tokens as overlapped ones (the default), in a crowd too.
    sync = make_llm(model_dir, block_size=8, async_scheduling=False)
    assert sync.generate(crowd, params, use_tqdm=False)[4].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, seed=1235, max_tokens=16)
    assert llm.generate({"prompt_token_ids": ids[1]}, other, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_no_leak(llm)


def test_n_forks_equal_independent_requests_with_derived_seeds(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompt = prompt_ids(model_dir)[5]  # long: many shared prompt blocks
    n, seed = 4, 77
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=10),
                       use_tqdm=False)[0]
    peak_forked = llm.get_kv_cache_stats().peak_blocks_used
    assert_no_leak(llm)
    assert [c.index for c in out.outputs] == list(range(n))

    llm2 = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    singles = llm2.generate([{"prompt_token_ids": prompt}] * n,
                            [SamplingParams(temperature=1.0, seed=derive_seed(seed, i), max_tokens=10)
                             for i in range(n)], use_tqdm=False)
    peak_independent = llm2.get_kv_cache_stats().peak_blocks_used
    for c, single in zip(out.outputs, singles):
        assert c.token_ids == single.outputs[0].token_ids
        assert c.cumulative_logprob == pytest.approx(single.outputs[0].cumulative_logprob, abs=1e-4)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Forks share the prompt's blocks; independent requests each hold a copy.
    assert peak_forked < peak_independent
    assert_no_leak(llm2)


def test_best_of_returns_the_n_most_likely(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompt = prompt_ids(model_dir)[0]
    llm = make_llm(model_dir, block_size=8)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)[0]
    singles = llm.generate([{"prompt_token_ids": prompt}] * 5,
                           [SamplingParams(temperature=1.0, seed=derive_seed(3, i), max_tokens=6) for i in range(5)],
                           use_tqdm=False)
    ranked = sorted((s.outputs[0] for s in singles), key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert_no_leak(llm)


def test_n_greater_than_one_under_swap_preemption(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)[:6]
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    roomy = make_llm(model_dir, block_size=4)
    ref = roomy.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    tight = make_llm(model_dir, block_size=4, num_gpu_blocks_override=40, swap_space=0.05)
    got = tight.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert tight.get_kv_cache_stats().num_preemptions > 0
    for a, b in zip(ref, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_no_leak(tight)


def test_max_logprobs_bounds_requests_and_minus_one_is_the_vocab(tiny_model_dir):
    """--max-logprobs (vLLM's): a request asking for more is refused naming both numbers; -1 lets
    one ask for the whole vocabulary, which then matches HF's log_softmax everywhere."""
    model_dir = tiny_model_dir("llama")
    p = prompt_ids(model_dir)[0]
    llm = make_llm(model_dir, block_size=4, max_logprobs=3)
    with pytest.raises(ValueError, match=r"logprobs \(4\) must be <= max_logprobs \(3"):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs \(5\) must be <= max_logprobs \(3"):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=2, logprobs=3),
                        use_tqdm=False)[0].outputs[0].logprobs
    vocab = llm.llm_engine.vocab_size
    llm = make_llm(model_dir, block_size=4, max_logprobs=-1)
    c = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=3, logprobs=vocab),
                     use_tqdm=False)[0].outputs[0]
    ref = _hf_logprobs(model_dir, p, c.token_ids)
    for pos, lps in enumerate(c.logprobs):
        assert sorted(lps) == list(range(vocab))
        assert torch.allclose(torch.tensor([lps[t].logprob for t in range(vocab)]), ref[pos], atol=1e-4)
    with pytest.raises(ValueError, match=rf"max_logprobs \({vocab}"):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    # vLLM's -1: the whole vocabulary, for sampled and prompt positions alike
    o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=2, logprobs=-1,
                                                               prompt_logprobs=-1), use_tqdm=False)[0]
    assert [sorted(lps) for lps in o.outputs[0].logprobs] == [list(range(vocab))] * 2
    assert o.outputs[0].logprobs == c.logprobs[:2] and o.outputs[0].token_ids == c.token_ids[:2]
    assert o.prompt_logprobs[0] is None and all(sorted(d) == list(range(vocab)) for d in o.prompt_logprobs[1:])
    ref_prompt = _hf_logprobs(model_dir, p[:1], p[1:])
    for j, d in enumerate(o.prompt_logprobs[1:]):
        assert next(iter(d)) == p[j + 1]  # the prompt's own token first, as vLLM's dict
        assert torch.allclose(torch.tensor([d[t].logprob for t in range(vocab)]), ref_prompt[j], atol=1e-4)
    llm = make_llm(model_dir, block_size=4, max_logprobs=3)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name} \(-1: the whole vocabulary, {vocab}\) must be <= max_logprobs \(3"):
            llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, **{name: -1}), use_tqdm=False)
        with pytest.raises(ValueError, match=rf"{name} must be >= 0, or -1"):
            SamplingParams(**{name: -2})


def test_max_logprobs_below_minus_one_is_refused():
    from pagedserve.config import EngineConfig
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        EngineConfig(max_logprobs=-2)


def _hf_greedy_processed(model_dir, prompt, n, bias=None, allowed=None):
    """HF's greedy tokens with the logits biased / limited at each step (full forward, no cache)."""
    model = hf_model(str(model_dir))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t, b in (bias or {}).items():
                logits[t] += b
            if allowed is not None:
                keep = torch.full_like(logits, float("-inf"))
                keep[allowed] = logits[allowed]
                logits = keep
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_logit_bias_and_allowed_token_ids_match_hf(tiny_model_dir):
    """OpenAI's logit_bias and vLLM's allowed_token_ids change the draw, not the logprobs: greedy
    tokens equal HF's argmax of the biased (or limited) logits, each chosen token's logprob is the
    raw one; sampled tokens stay inside allowed_token_ids."""
    model_dir = tiny_model_dir("llama")
    p = prompt_ids(model_dir)[1]
    llm = make_llm(model_dir, block_size=4)
    plain = hf_greedy(model_dir, p, 6)
    bias = {plain[0]: -5.0, 17: 4.0, 33: 3.5}
    allowed = [5, 17, 33, 101]
    params = [SamplingParams(temperature=0, max_tokens=6, logit_bias=bias, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed[:2])]
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p}] * 3, params, use_tqdm=False)]
    biased = _hf_greedy_processed(model_dir, p, 6, bias=bias)
    assert outs[0].token_ids == biased != plain
    ref = _hf_logprobs(model_dir, p, biased)
    assert [lp[t].logprob for t, lp in zip(biased, outs[0].logprobs)] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(biased)], abs=1e-4)
    assert outs[1].token_ids == _hf_greedy_processed(model_dir, p, 6, allowed=allowed)
    assert set(outs[2].token_ids) <= set(allowed[:2]) and len(set(outs[2].token_ids)) == 2
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, "):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    assert_no_leak(llm)


def test_bad_words_are_never_generated(tmp_path):
    """vLLM's bad_words on the demo model (a GPT-2-style tokenizer): "a man" is banned as it
    would start the text ([70, 407]) and after a space ([265, 407]): 407 is not drawn right after
    70 or 265 (synchronous steps: the rule reads the newest token); "a" alone is one token either
    way, never drawn (a fixed ban, overlapped steps). Greedy equals HF's argmax with the same bans."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM
    from pagedserve.demo_model import DEMO_MODEL_DIR
    from pagedserve.engine.bad_words import tokenize_bad_words
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    assert tokenize_bad_words(["a man"], tok) == [[70, 407], [265, 407]]
    assert tokenize_bad_words([" a"], tok) == [[70], [265]]
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32).eval()
    prompt = tok("And God said,").input_ids

    def hf(banned_after: dict, always: set, n: int = 24) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                out = ids[len(prompt):]
                for t in always | (banned_after.get(out[-1], set()) if out else set()):
                    logits[t] = float("-inf")
                ids.append(int(logits.argmax()))
        return ids[len(prompt):]

    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="float32", num_gpu_blocks_override=128, swap_space=0.01)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert " a man" in plain.text
    for words, after, always in ((["a man"], {70: {407}, 265: {407}}, set()), (["a"], {}, {70, 265})):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, bad_words=words),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf(after, always) != plain.token_ids
        assert " a man" not in out.text
    with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
        SamplingParams(bad_words=[" "])
