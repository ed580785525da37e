"""Beam search equals HF generate(num_beams=k, early_stopping=True) and shares blocks by copy-on-write."""
import pytest
import torch

from pagedserve import BeamSearchParams

from logprob_reference import vllm_name
from .helpers import assert_no_leak, hf_greedy, hf_model, make_llm, prompt_ids, tokenizer

K, MAX_NEW = 3, 8


def _hf_beams(model_dir, prompt, eos, length_penalty):
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, num_beams=K, early_stopping=True, length_penalty=length_penalty,
                             num_return_sequences=K, max_new_tokens=MAX_NEW, pad_token_id=2, eos_token_id=eos,
                             output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores.tolist()):
        toks = seq[len(prompt):].tolist()
        if eos in toks:
            toks = toks[:toks.index(eos) + 1]
        beams.append((toks, score))
    return beams


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_matches_hf(tiny_model_dir, arch, length_penalty):
    model_dir = tiny_model_dir(arch)
    ids = prompt_ids(model_dir)[:4]
    # A token the model likes to emit plays EOS, so hypotheses end at different lengths and
    # the length penalty matters.
    eos = hf_greedy(model_dir, ids[0], 3)[2]
    llm = make_llm(model_dir, block_size=4)
    engine = llm.llm_engine
    engine.eos_token_ids.clear()
    engine.eos_token_ids.add(eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in ids],
                           BeamSearchParams(beam_width=K, max_tokens=MAX_NEW, length_penalty=length_penalty))
    ended_by_eos = 0
    for p, out in zip(ids, outs):
        ref = _hf_beams(model_dir, p, eos, length_penalty)
        assert [s.output_tokens for s in out.sequences] == [t for t, _ in ref], p
        for s, (_, score) in zip(out.sequences, ref):
            assert s.score == pytest.approx(score, abs=1e-4)
            assert s.tokens == p + s.output_tokens
            ended_by_eos += s.finish_reason == "stop"
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    assert ended_by_eos > 0
    assert_no_leak(llm)


def test_beams_share_prompt_blocks(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompt = prompt_ids(model_dir)[5]
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    width = 4
    out = llm.beam_search({"prompt_token_ids": prompt},
                          BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True))[0]
    assert len(out.sequences) == width
    assert all(len(s.output_tokens) == 6 and s.finish_reason == "length" for s in out.sequences)
    prompt_blocks = -(-len(prompt) // 4)
    peak = llm.get_kv_cache_stats().peak_blocks_used
    # One copy of the prompt plus a few diverged tail blocks per beam, not width copies.
    assert peak < prompt_blocks + width * 4
    assert peak < width * prompt_blocks
    assert out.sequences[0].text == llm.get_tokenizer().decode(out.sequences[0].tokens, skip_special_tokens=True)
    assert_no_leak(llm)


def test_beam_search_unchanged_by_swaps_and_split_steps(tiny_model_dir):
    """A tight cache (beam groups are swapped out whole) and a token budget smaller than the
    number of live beams (a group's beams then run in different steps) give the same beams."""
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)[:4]
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True, length_penalty=0.5)
    roomy = make_llm(model_dir, block_size=4).beam_search([{"prompt_token_ids": p} for p in ids], params)
    tight = make_llm(model_dir, block_size=4, num_gpu_blocks_override=30, swap_space=0.05)
    split = make_llm(model_dir, block_size=4, max_num_batched_tokens=3)
    sched = split.llm_engine.scheduler
    schedule, partial = sched.schedule, []

    def spy():
        out = schedule()
        per_group = {}
        for ss in out.scheduled:
            per_group.setdefault(id(ss.group), [ss.group, 0])[1] += ss.is_decode
        partial.extend(g for g, n in per_group.values() if 0 < n < len(g.unfinished_seqs()))
        return out
    sched.schedule = spy
    for llm in (tight, split):
        got = llm.beam_search([{"prompt_token_ids": p} for p in ids], params)
        for a, b in zip(roomy, got):
            assert [s.output_tokens for s in a.sequences] == [s.output_tokens for s in b.sequences]
            assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-4)
        assert_no_leak(llm)
    assert tight.get_kv_cache_stats().num_preemptions > 0
    assert partial


def test_emitted_output_equals_the_kept_result(tiny_model_dir):
    """emit_output (the engine core serving the API server): step() returns the finished search
    as a RequestOutput, hypotheses best first, the same beams LLM.beam_search takes."""
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)[:2]
    eos = hf_greedy(model_dir, ids[0], 3)[2]
    llm = make_llm(model_dir, block_size=4)
    engine = llm.llm_engine
    engine.eos_token_ids.clear()
    engine.eos_token_ids.add(eos)
    params = BeamSearchParams(beam_width=K, max_tokens=MAX_NEW, length_penalty=0.5)
    kept = llm.beam_search([{"prompt_token_ids": p} for p in ids], params)
    for i, p in enumerate(ids):
        engine.add_beam_search_request(f"e{i}", {"prompt_token_ids": p}, params, emit_output=True)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.request_id not in got
            got[out.request_id] = out
    assert not engine._beams.results and not engine._beams.emitting
    for i, p in enumerate(ids):
        out, ref = got[f"e{i}"], kept[i].sequences
        assert out.prompt_token_ids == p and out.error is None
        assert [c.index for c in out.outputs] == list(range(len(ref)))
        assert [c.token_ids for c in out.outputs] == [s.output_tokens for s in ref]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([s.cum_logprob for s in ref])
        assert [c.finish_reason for c in out.outputs] == [s.finish_reason for s in ref]
        assert [c.stop_reason for c in out.outputs] == [eos if s.finish_reason == "stop" else None for s in ref]
        assert "first_token_time" in out.metrics and "finished_time" in out.metrics
    assert any(s.finish_reason == "stop" for o in kept for s in o.sequences)
    assert_no_leak(llm)


def _hf_logp(model_dir, ids):
    """HF's float32 log_softmax after every position of ids."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("asked", [None, 2 * K + 3])
def test_every_hypothesis_carries_each_steps_top_logprobs(tiny_model_dir, asked):
    """BeamSearchSequence.logprobs, vLLM's field: per generated token (a "stop" hypothesis' EOS
    included), the top max(2 * beam_width, logprobs) tokens of the step that produced it, HF's
    log_softmax at prompt + tokens before it, ranked 1..N in order, named as sampled logprobs are;
    the chosen tokens' values sum to cum_logprob; beams forked from one parent carry its dicts."""
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    ids = [prompt_ids(model_dir)[i] for i in (0, 3, 6)]  # 3, 6: multi-byte characters split in tokens
    eos = hf_greedy(model_dir, ids[0], 3)[2]
    llm = make_llm(model_dir, block_size=4)
    llm.llm_engine.eos_token_ids.clear()
    llm.llm_engine.eos_token_ids.add(eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in ids],
                           BeamSearchParams(beam_width=K, max_tokens=MAX_NEW, logprobs=asked))
    n_top = max(2 * K, asked or 0)
    shared = stopped = named_in_context = 0
    for p, out in zip(ids, outs):
        for s in out.sequences:
            ref = _hf_logp(model_dir, p + s.output_tokens)
            assert len(s.logprobs) == len(s.output_tokens)
            for i, (t, d) in enumerate(zip(s.output_tokens, s.logprobs)):
                want = ref[len(p) - 1 + i].topk(n_top)
                assert list(d) == want.indices.tolist(), (p, s.output_tokens, i)
                assert [v.logprob for v in d.values()] == pytest.approx(want.values.tolist(), abs=1e-4)
                assert [v.rank for v in d.values()] == list(range(1, n_top + 1))
                context = s.output_tokens[max(0, i - 4):i]
                assert [v.decoded_token for v in d.values()] == [vllm_name(tok, x, context) for x in d]
                named_in_context += any(v.decoded_token != tok.decode([x]) for x, v in d.items())
            assert sum(d[t].logprob for t, d in zip(s.output_tokens, s.logprobs)) == \
                pytest.approx(s.cum_logprob, abs=1e-9)
            stopped += s.finish_reason == "stop"
        # Hypotheses that share their first tokens came from one beam's forks: they carry the
        # same dicts for them, the parent's.
        for a in out.sequences:
            for b in out.sequences:
                common = next((i for i, (x, y) in enumerate(zip(a.output_tokens, b.output_tokens)) if x != y), 0)
                assert a.logprobs[:common] == b.logprobs[:common]
                shared += a is not b and common > 0
    assert stopped and shared and named_in_context
    assert_no_leak(llm)


def test_emitted_logprobs_only_when_asked(tiny_model_dir):
    """For the server (emit_output), a hypothesis' logprobs cross as a sampled token's do: the
    chosen token first with its rank, then the top `logprobs` of the step; none unless asked. More
    than --max-logprobs is refused as for sampling; -1 is the whole vocabulary."""
    model_dir = tiny_model_dir("llama")
    p = prompt_ids(model_dir)[1]
    llm = make_llm(model_dir, block_size=4, max_logprobs=-1)
    engine = llm.llm_engine
    kept = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=2, max_tokens=5))[0].sequences
    for rid, asked in (("none", None), ("two", 2), ("zero", 0)):
        engine.add_beam_search_request(rid, {"prompt_token_ids": p},
                                       BeamSearchParams(beam_width=2, max_tokens=5, logprobs=asked), emit_output=True)
    got = {}
    while engine.has_unfinished_requests():
        got.update((o.request_id, o) for o in engine.step())
    assert all(c.logprobs is None for c in got["none"].outputs)
    for rid, k in (("two", 2), ("zero", 0)):
        assert [c.token_ids for c in got[rid].outputs] == [s.output_tokens for s in kept]
        for c, s in zip(got[rid].outputs, kept):
            assert len(c.logprobs) == len(c.token_ids)
            for t, pos, d in zip(c.token_ids, c.logprobs, s.logprobs):
                top = list(d.items())[:k]
                assert pos.token_ids == [t] + [x for x, _ in top]
                # float noise: three searches batched here, one alone there
                assert pos.logprobs == pytest.approx([d[t].logprob] + [v.logprob for _, v in top], abs=1e-5)
                assert pos.rank == d[t].rank
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_beam_search_request("big", {"prompt_token_ids": p},
                                       BeamSearchParams(2, 5, logprobs=engine.vocab_size + 1))
    whole = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(beam_width=2, max_tokens=2, logprobs=-1))
    assert all(len(d) == engine.vocab_size for s in whole[0].sequences for d in s.logprobs)
    assert_no_leak(llm)
