"""Routing policies and routing keys on their own (no servers)."""
from __future__ import annotations

import random
import sys

import pytest

from pagedserve.serving.metrics_merge import merge_replica_metrics
from pagedserve.serving.prefix_key import prefix_block_hashes, request_token_ids
from pagedserve.serving.routing import PrefixAffinityPolicy, RoundRobinPolicy, make_policy


def test_routing_key_is_the_engines_own_block_hash_chain():
    """The hashes the router computes are exactly those the engine registers in its prefix
    cache for the same prompt (block size 16, demo model)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.demo_model import DEMO_MODEL_DIR
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="float32", block_size=16,
              num_gpu_blocks_override=64, swap_space=0.01)
    prompt = [random.Random(0).randrange(3, 2000) for _ in range(16 * 3 + 5)]
    llm.generate([prompt],
                 SamplingParams(max_tokens=1, temperature=0))
    cached = set(llm.llm_engine.scheduler.kv_cache_manager.pool.cached_block_hash_to_block)
    ours = prefix_block_hashes(prompt, 16)
    assert len(ours) == 3 and set(ours) <= cached
    assert prefix_block_hashes(prompt, 16, max_blocks=2) == ours[:2]
    assert prefix_block_hashes(prompt[:15], 16) == []
    # vLLM's cache_salt: the engine chains a salted prompt's blocks from the salt; so does the router.
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], SamplingParams(max_tokens=1, temperature=0))
    salted = prefix_block_hashes(prompt, 16, cache_salt="tenant-a")
    cached = set(llm.llm_engine.scheduler.kv_cache_manager.pool.cached_block_hash_to_block)
    assert set(salted) <= cached and not set(salted) & set(ours)


def test_request_token_ids_reads_completions_and_chat_bodies():
    from transformers import AutoTokenizer

    from pagedserve.demo_model import DEMO_MODEL_DIR
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    text = "In the beginning God created the heaven and the earth."
    assert request_token_ids(tok, "/v1/completions", b'{"prompt": "%s"}' % text.encode()) == \
        tok(text).input_ids
    assert request_token_ids(tok, "/v1/completions", b'{"prompt": [[5, 6], [7]]}') == [5, 6]
    msgs = [{"role": "user", "content": text}]
    chat = request_token_ids(tok, "/v1/chat/completions", b'{"messages": [{"role": "user", '
                             b'"content": "%s"}]}' % text.encode())
    assert chat == tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False).input_ids
    for bad in (b"not json", b"[1, 2]", b'{"prompt": 3}', b'{"messages": "x"}'):
        assert request_token_ids(tok, "/v1/chat/completions", bad) == []


def test_chat_keys_follow_the_replicas_chat_template(tmp_path):
    """With --chat-template the router (and each relay worker, on its command line) renders chat
    prompts by that template, as the replicas do, not by the tokenizer's own."""
    from transformers import AutoTokenizer

    from pagedserve.config import EngineConfig
    from pagedserve.demo_model import DEMO_MODEL_DIR
    from pagedserve.serving.prefix_key import load_tokenizer
    from pagedserve.serving.relay_worker import RelayWorkers, parse_worker_args
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    config = EngineConfig(model=str(DEMO_MODEL_DIR), chat_template=str(tmp_path / "t.jinja"))
    msgs = [{"role": "user", "content": "In the beginning"}]
    ref = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    expected = ref(ref.apply_chat_template(msgs, chat_template=template, add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids
    body = b'{"messages": [{"role": "user", "content": "In the beginning"}]}'
    assert request_token_ids(load_tokenizer(config), "/v1/chat/completions", body) == expected
    assert expected != request_token_ids(ref, "/v1/chat/completions", body)
    cmd = RelayWorkers(1, "127.0.0.1", 1, "ipc://x", str(DEMO_MODEL_DIR), 16, 1024,
                       chat_template=config.chat_template).cmds[0]
    assert cmd[:3] == [sys.executable, "-m", "pagedserve.serving.relay_worker"]
    args = parse_worker_args(cmd[3:])
    assert (args.tokenizer, args.chat_template) == (str(DEMO_MODEL_DIR), str(tmp_path / "t.jinja"))


def test_prefix_policy_keeps_a_prefix_on_its_replica_and_spreads_new_ones():
    p = PrefixAffinityPolicy(imbalance_threshold=2)
    loads = {"a": 0, "b": 0}
    group1 = prefix_block_hashes(list(range(64)), 16)
    group2 = prefix_block_hashes(list(range(100, 164)), 16)
    first = p.choose(group1, loads)
    second = p.choose(group2, loads)
    assert {first, second} == {"a", "b"}  # new groups spread even with nothing in flight
    for _ in range(5):
        assert p.choose(group1, loads) == first
    # a longer request sharing only the first two blocks still follows them
    assert p.choose(prefix_block_hashes(list(range(32)) + [999] * 40, 16), loads) == first


def test_prefix_policy_falls_back_to_least_loaded_when_the_holder_is_busy():
    p = PrefixAffinityPolicy(imbalance_threshold=2)
    key = prefix_block_hashes(list(range(48)), 16)
    holder = p.choose(key, {"a": 0, "b": 0})
    other = "b" if holder == "a" else "a"
    assert p.choose(key, {holder: 2, other: 0}) == holder      # within the threshold
    assert p.choose(key, {holder: 3, other: 0}) == other       # beyond it
    assert p.choose(key, {holder: 0, other: 0}) == other       # the prefix now lives there too
    p.forget(other)
    assert p.choose(key, {holder: 0, other: 5}) == holder      # forgotten: least loaded
    assert p.choose(key, {other: 5}) == other                  # only live replicas are chosen


def test_prefix_policy_map_is_bounded():
    p = PrefixAffinityPolicy(max_entries=10)
    for g in range(20):
        p.choose(prefix_block_hashes(list(range(g * 1000, g * 1000 + 32)), 16), {"a": 0})
    assert len(p._owner) == 10


def test_round_robin_and_bad_names():
    rr = RoundRobinPolicy()
    assert [rr.choose([], {"x": 9, "y": 0}) for _ in range(4)] == ["x", "y", "x", "y"]
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="imbalance_threshold"):
        PrefixAffinityPolicy(imbalance_threshold=-1)
    with pytest.raises(ValueError, match="no live replica"):
        PrefixAffinityPolicy().choose([], {})


def test_merge_adds_the_replica_label_and_keeps_values():
    from pagedserve.metrics import ServerMetrics
    a, b = ServerMetrics(), ServerMetrics()
    a.time_to_first_token.observe(0.03)
    b.prompt_tokens.inc(4)
    text = merge_replica_metrics({"0": a.render().decode(), "1": b.render().decode()}).decode()
    assert 'vllm:prompt_tokens_total{replica="1"} 4.0' in text
    assert 'vllm:prompt_tokens_total{replica="0"} 0.0' in text
    assert 'vllm:time_to_first_token_seconds_count{replica="0"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.04",replica="0"} 1.0' in text
    assert text.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1


def test_without_a_tokenizer_only_token_id_prompts_have_a_key():
    assert request_token_ids(None, "/v1/completions", b'{"prompt": [5, 6, 7]}') == [5, 6, 7]
    assert request_token_ids(None, "/v1/completions", b'{"prompt": "text"}') == []
    assert request_token_ids(None, "/v1/chat/completions", b'{"messages": []}') == []
