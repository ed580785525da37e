"""Shared pieces of the tensor-parallel tests: prompts, greedy runs, and finding leftover workers."""
from __future__ import annotations

import os

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores the KV cache in fixed-size blocks, like pages of virtual memory.",
    "def main():\n    print('hello, world')",
    "Привет, мир! Как дела?",
]


# Steps run both ways: a request that asks for logprobs makes every step synchronous (the engine's
# overlap cannot serve top-N logprobs), one that does not lets steps overlap.
STEP_MODES = {"sync": 3, "overlap": None}  # name -> the logprobs to ask for


def greedy(llm: LLM, prompts=PROMPTS, max_tokens: int = 16, logprobs: int | None = 3):
    """(token ids, per-token logprob dicts) of each prompt, greedy, ignoring EOS. logprobs=None
    lets the steps overlap (STEP_MODES); the logprob dicts are then None. With logprobs the
    request also asks for prompt_logprobs, which keeps every step synchronous (logprobs alone
    overlap)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                        prompt_logprobs=None if logprobs is None else 0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_same_greedy(ref, got, atol: float = 1e-4) -> None:
    """Same tokens, and the top logprobs agree to float32 reduction-order noise."""
    ref_ids, ref_lp = ref
    got_ids, got_lp = got
    assert got_ids == ref_ids
    for a_seq, b_seq in zip(ref_lp, got_lp):
        if a_seq is None:
            continue
        for a, b in zip(a_seq, b_seq):
            assert set(a) == set(b)
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) <= atol, (tok, a[tok], b[tok])


def count_placeholder_steps(llm: LLM) -> list[int]:
    """From now on, counter[0] counts the steps the engine plans around a placeholder: overlapped
    steps, whose other ranks read the previous step's ids from rank 0's broadcast."""
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule
    counter = [0]

    def spy():
        out = schedule()
        counter[0] += any(s.seq.num_inflight_tokens for s in out.scheduled)
        return out
    engine.scheduler.schedule = spy
    return counter


def launch_children(parent: int | None = None) -> list[int]:
    """Pids of live `pagedserve.runner.launch` processes (children of `parent` when given)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z":
            continue
        if b"pagedserve.runner.launch" in cmd and (parent is None or int(ppid) == parent):
            pids.append(int(entry))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group (Linux: /proc)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)
