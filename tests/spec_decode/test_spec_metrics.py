"""Speculative decoding's counters reach /metrics (vLLM's names under pagedserve: and vllm:; the
paused-step counter, ours, under pagedserve: only),
through the engine core's snapshot exactly as the server reads it, and the core utility."""
import msgspec

from pagedserve import SamplingParams
from pagedserve.engine.core import EngineCore
from pagedserve.metrics import EngineSnapshot, ServerMetrics
from engine.helpers import make_llm, tokenizer
from spec_decode.spec_helpers import NGRAM_EAGER_PAUSE, TEXTS, verified_probes


def test_counters_in_metrics_and_core_utility(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = verified_probes(make_llm(model_dir, block_size=4, speculative_config=NGRAM_EAGER_PAUSE))
    tok = tokenizer(str(model_dir))
    llm.generate([{"prompt_token_ids": tok.encode(TEXTS[0])}],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    dash = llm.llm_engine.get_kv_cache_state()["spec_decode"]  # the dashboard's snapshot
    assert dash["num_accepted_tokens"] == stats.num_accepted_tokens
    assert dash["acceptance_rate"] == stats.num_accepted_tokens / stats.num_draft_tokens
    core = EngineCore(None, engine=llm.llm_engine)
    snap = msgspec.json.decode(msgspec.json.encode(core.snapshot()), type=EngineSnapshot)  # as it travels
    assert core.call_utility("get_spec_decode_stats", [])["num_drafts"] == stats.num_drafts
    m = ServerMetrics(model_name="tiny")
    m.observe_snapshot(snap)
    text = m.render().decode()
    for prefix, label in (("pagedserve:", ""), ("vllm:", '{model_name="tiny"}')):
        assert f"{prefix}spec_decode_num_draft_tokens_total{label} {float(stats.num_draft_tokens)}" in text
        assert f"{prefix}spec_decode_num_accepted_tokens_total{label} {float(stats.num_accepted_tokens)}" in text
        assert f"{prefix}spec_decode_num_drafts_total{label} {float(stats.num_drafts)}" in text
        assert f"{prefix}spec_decode_proposer_seconds_total" in text
    # A step not wholly accepted pauses speculation at this threshold: some steps were paused.
    assert stats.num_paused_steps > 0 and dash["num_paused_steps"] == stats.num_paused_steps
    assert f"pagedserve:spec_decode_paused_steps_total {float(stats.num_paused_steps)}" in text
    assert "vllm:spec_decode_paused_steps" not in text  # vLLM has no such counter: no alias
    assert f"pagedserve:spec_decode_unproposed_steps_total {float(stats.num_unproposed_steps)}" in text
    assert f"pagedserve:spec_decode_shadow_probes_total {float(stats.num_shadow_probes)}" in text
    pos0 = float(stats.num_accepted_tokens_per_pos[0])
    assert f'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {pos0}' in text


def test_no_series_without_speculation():
    m = ServerMetrics()
    m.observe_snapshot(EngineSnapshot())
    assert "spec_decode" not in m.render().decode()


def test_shadow_probe_and_unproposed_counters(tiny_model_dir):
    """Ours alone under pagedserve: (no vLLM alias): the n-gram's shadow probes and the steps it
    had nothing for, as the engine counted them."""
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM_EAGER_PAUSE)
    tok = tokenizer(str(model_dir))
    llm.generate([{"prompt_token_ids": tok.encode(t)} for t in TEXTS[:3]],
                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.get_spec_decode_stats()
    assert stats.num_shadow_probes > 0 and stats.num_unproposed_steps > 0
    core = EngineCore(None, engine=llm.llm_engine)
    snap = msgspec.json.decode(msgspec.json.encode(core.snapshot()), type=EngineSnapshot)
    m = ServerMetrics(model_name="tiny")
    m.observe_snapshot(snap)
    text = m.render().decode()
    assert f"pagedserve:spec_decode_shadow_probes_total {float(stats.num_shadow_probes)}" in text
    assert f"pagedserve:spec_decode_unproposed_steps_total {float(stats.num_unproposed_steps)}" in text
    assert "vllm:spec_decode_shadow_probes" not in text
