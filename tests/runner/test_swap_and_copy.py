"""Swapping a sequence's blocks out and back in (to different device blocks), and copy-on-write
after a fork, leave greedy outputs exactly as HF computes them."""
import torch

from paged_harness import HandDriver, hf_greedy, hf_model, make_runner

PROMPT_A, PROMPT_B = list(range(60, 73)), [11, 12, 13, 14, 15, 16]
N = 8


def test_swap_out_clobber_swap_in_continues(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ref = hf_model(model_dir)
    runner = make_runner(model_dir, block_size=4, num_blocks=64, num_cpu_blocks=16)
    d = HandDriver(runner, seed=1)
    a, b = d.add(PROMPT_A), d.add(PROMPT_B)
    d.step([d.schedule(a), d.schedule(b)])
    for _ in range(2):
        d.step([d.schedule(a), d.schedule(b)])
    # Preempt A by swap: its device blocks go to scattered CPU blocks, in a step where B keeps decoding.
    old = d.tables[a.seq_id]
    cpu_blocks = [15 - 2 * i for i in range(len(old))]
    d.step([d.schedule(b)], blocks_to_swap_out=list(zip(old, cpu_blocks)))
    # The device blocks are free now: another tenant overwrites them.
    pool = runner.cache_engine.gpu_pool
    pool[:, :, old] = torch.randn_like(pool[:, :, old])
    d.free.extend(old)
    # Swap A back in to different device blocks, in the same step as its next decode.
    new = [d.free.pop(0) for _ in old]
    assert not set(new) & set(old)
    d.tables[a.seq_id] = list(new)
    d.step([d.schedule(a), d.schedule(b)], blocks_to_swap_in=list(zip(cpu_blocks, new)))
    while len(a.output_token_ids) < N or len(b.output_token_ids) < N:
        d.step([d.schedule(s) for s in (a, b) if len(s.output_token_ids) < N])
    assert a.output_token_ids[:N] == hf_greedy(ref, PROMPT_A, N)
    assert b.output_token_ids[:N] == hf_greedy(ref, PROMPT_B, N)


def test_swap_roundtrip_is_exact(tiny_model_dir):
    runner = make_runner(tiny_model_dir("qwen3"), block_size=4, num_blocks=32, num_cpu_blocks=8)
    ce = runner.cache_engine
    ce.gpu_pool.copy_(torch.randn_like(ce.gpu_pool))
    before = ce.gpu_pool.clone()
    ce.swap_out([(3, 7), (30, 0), (12, 5)])
    ce.gpu_pool[:, :, [3, 30, 12]] = 0
    ce.swap_in([(7, 3), (0, 30), (5, 1)])
    assert torch.equal(ce.gpu_pool[:, :, [3, 30]], before[:, :, [3, 30]])
    assert torch.equal(ce.gpu_pool[:, :, 1], before[:, :, 12])


def test_copy_on_write_after_fork(tiny_model_dir):
    """A child forked after the prompt shares its blocks; the partly filled last block is copied
    (blocks_to_copy) before the child writes; parent and child then diverge correctly."""
    model_dir = tiny_model_dir("qwen2")
    ref = hf_model(model_dir)
    runner = make_runner(model_dir, block_size=4, num_blocks=32)
    d = HandDriver(runner, seed=2)
    pool = runner.cache_engine.gpu_pool
    pool.copy_(torch.randn_like(pool) * 3)  # free blocks hold stale data, as they do in a running engine
    parent = d.add(PROMPT_A)  # 13 tokens: last block holds 1 token
    d.step([d.schedule(parent)])
    child = parent.fork()
    child.output_token_ids[-1] = (parent.output_token_ids[-1] + 1) % 300  # a different sampled token
    d.groups[child.seq_id] = d.groups[parent.seq_id]
    shared = d.tables[parent.seq_id]
    copy_dst = d.free.pop()
    d.tables[child.seq_id] = shared[:-1] + [copy_dst]
    d.step([d.schedule(parent), d.schedule(child)], blocks_to_copy=[(shared[-1], copy_dst)])
    while len(child.output_token_ids) < N:
        d.step([d.schedule(parent), d.schedule(child)])
    assert parent.output_token_ids[:N] == hf_greedy(ref, PROMPT_A, N)
    first = child.output_token_ids[0]
    assert child.output_token_ids[1:N] == hf_greedy(ref, PROMPT_A + [first], N - 1)
