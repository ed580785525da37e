"""Host overhead per decode step at a full batch of running sequences.

Builds an LLMEngine, adds --num-seqs requests (random prompt ids, ignore_eos, temperature 0.6,
max_tokens as large as the model allows), steps until every one of them is a running decode,
then times --steps decode steps with the engine's StepTimer, split into phases:

  schedule     Scheduler.schedule()
  cache_ops    runner work before input building (swap / copy-on-write; none in steady decode)
  prepare      input building: token ids, positions, slot mapping, block tables -> device
  forward      model forward + logits (device time: synchronized on both sides; excluded)
  sample       Sampler.sample (device ops plus the one device->host copy; reported apart)
  postprocess  update_after_step, sample rows, append tokens, stop checks, outputs, frees

Host overhead (`results.ms_per_decode_step_at_256`) is schedule + cache_ops + prepare +
postprocess, the median over the timed steps. The input-building split relies on the runner
calling DeviceRequestState.prepare (the persistent device state, the engine's default) or
HostBatch.to_model_input (PAGEDSERVE_INCREMENTAL_INPUTS=0: every table rebuilt); if a runner
stops doing either, the prepare time shows up inside `forward` and the JSON says so. With --async-scheduling (the engine's default) the step
launches the device work and sampling without waiting (`forward` and `sample` are launch time
and count as host work) and `wait` is the time spent waiting for the previous step's tokens.

What overlapping is for: `results.gpu_idle_ms_per_decode_step` (CUDA only), the host time the
GPU waits for. A second pass of --steps steps runs with no synchronization at all and CUDA
events around each step's device work; the gap from one step's last kernel to the next step's
first is the time the device sat idle waiting for the host (median over the steps). Run it
with --async-scheduling and --no-async-scheduling for the A/B.

  python benchmarks/offline/host_overhead.py                                     # tiny llama, CPU or CUDA
  python benchmarks/offline/host_overhead.py --attention-layer   # one eager attention layer's wrappers

--attention-layer times instead the host side of one attention layer run eagerly, for 20 decodes
beside a 300-token chunk with Llama-3.1-8B's heads and every Triton kernel replaced by a stub that
launches nothing: write_kv and paged_attention (an eager step's layer), and paged_attention alone
(what piecewise graphs run between their pieces since the K/V write moved into them, 32 times a
step for an 8B model). Only our wrappers' Python and torch glue is timed (CPU is fine), not
Triton's own launcher (tens of microseconds a launch: kernels/graph_timing.py).
  python benchmarks/offline/host_overhead.py --model benchmarks/models/qwen3-0.6b --load-format dummy
"""
from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve.benchmark.results import engine_switches, git_commit, write_result  # noqa: E402
from pagedserve.benchmark.throughput import BENCH_TEMPERATURE  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine, make_engine_config  # noqa: E402
from pagedserve.engine.step_timer import NULL_STEP_TIMER, StepTimer  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402

HOST_PHASES = ("schedule", "cache_ops", "prepare", "postprocess")
ALL_PHASES = ("schedule", "cache_ops", "prepare", "forward", "sample", "wait", "postprocess")


def _hook_prepare(engine: LLMEngine) -> list[int]:
    """Time input building inside runner.execute by wrapping DeviceRequestState.prepare and
    HostBatch.to_model_input (host arrays to device tensors, whichever the runner uses); the
    host-array half (host_batch, the row tracker) lands in cache_ops, also host time.
    Returns a one-element call counter."""
    from pagedserve.runner.batch import HostBatch
    from pagedserve.runner.request_state import DeviceRequestState
    calls = [0]

    def wrap(cls, name):
        original = getattr(cls, name)

        def timed(self, *args, **kwargs):
            timer = engine.step_timer
            if timer is not NULL_STEP_TIMER:
                calls[0] += 1
            timer.mark("cache_ops", sync=True)
            result = original(self, *args, **kwargs)
            timer.mark("prepare", sync=True)
            return result
        setattr(cls, name, timed)
    wrap(HostBatch, "to_model_input")
    wrap(DeviceRequestState, "prepare")
    return calls


def _stub_forward(engine: LLMEngine) -> None:
    """Replace the model body with random hidden states: the CPU reference attention costs
    seconds per step at 256 sequences, and host phases do not depend on what the forward computes."""
    model = engine.runner.model
    width = model.lm_head.weight.shape[1]
    gen = torch.Generator(device=engine.device).manual_seed(0)

    def forward(input_ids, positions, kv_caches, attn_meta):
        return torch.randn(input_ids.shape[0], width, generator=gen, device=input_ids.device,
                           dtype=engine.dtype)
    model.forward = forward


def all_decoding(engine: LLMEngine, n: int) -> bool:
    sched = engine.scheduler
    if sched.waiting or sched.swapped or len(sched.running) != n:
        return False
    return all(s.is_decode for g in sched.running for s in g.seqs)


def prompt_bounds(prompt_len: tuple[int, int], max_len: int) -> tuple[int, int]:
    hi = min(prompt_len[1], max_len // 2)
    return min(prompt_len[0], hi), hi


def fill_decode_batch(engine: LLMEngine, n: int, prompt_len: tuple[int, int], temperature: float,
                      final_only: bool = True) -> int:
    """Add n requests of random ids (prompt lengths uniform in prompt_len, capped at half the
    context) that decode to the end of the context, and step until every one of them is a
    running decode; returns the steps taken. Shared with profile_decode.py."""
    max_len = engine.max_model_len
    lo, hi = prompt_bounds(prompt_len, max_len)
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    vocab = min(engine.vocab_size, 10000)
    for i, plen in enumerate(lens):
        ids = [rng.randrange(vocab) for _ in range(plen)]
        params = SamplingParams(temperature=temperature, max_tokens=max_len - plen, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    steps = 0
    while not all_decoding(engine, n):
        engine.step(final_only=final_only)
        steps += 1
        if steps > 10_000:
            raise RuntimeError("the batch never became all decodes: raise the KV cache or lower --num-seqs")
    return steps


def attention_layer_us(write_kv: bool = True, reps: int = 3000, num_decodes: int = 20, chunk: int = 300,
                       context: int = 1200) -> float:
    """Median over 5 runs of the mean host time (us) of one eager attention layer, kernels stubbed;
    write_kv False: paged_attention alone."""
    import itertools

    from pagedserve.attention import triton_cache, triton_ops, triton_prefill
    from pagedserve.attention.metadata import AttentionMetadata

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    for mod in (triton_ops, triton_cache, triton_prefill):  # write_kv launches triton_cache's kernel
        for name in dir(mod):
            if name.endswith("_kernel"):
                setattr(mod, name, NoLaunch())
    heads, kv_heads, head_dim, block_size, t = 32, 8, 128, 16, num_decodes + chunk
    kc = torch.zeros(4096, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    q = torch.zeros(t, heads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.zeros(t, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    one = torch.ones(1)
    q_lens, seq_lens = [1] * num_decodes + [chunk], [context + i for i in range(num_decodes)] + [chunk]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(num_decodes + 1, 128, dtype=torch.int32),
                             num_decodes, chunk, max(seq_lens), block_size, q_lens, seq_lens)

    def layer():
        if write_kv:
            triton_ops.write_kv(k, v, kc, vc, meta.slot_mapping, one, one)
        triton_ops.paged_attention(q, kc, vc, meta, head_dim ** -0.5, k_scale=one, v_scale=one)
    runs = []
    for _ in range(6):
        start = time.perf_counter()
        for _ in range(reps):
            layer()
        runs.append((time.perf_counter() - start) / reps * 1e6)
    return round(statistics.median(runs[1:]), 2)  # the first run warms up


def _ms(xs: list[float]) -> float:
    """Median in milliseconds."""
    return round(1e3 * statistics.median(xs), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: a tiny random llama made now)")
    ap.add_argument("--load-format", default=None, help="auto | safetensors | dummy (default: dummy with --model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--prompt-len", default="100,400", help="lo,hi: uniform prompt lengths (clipped to the model)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--engine-args", default="", help="extra engine kwargs as k=v, space separated")
    ap.add_argument("--stub-forward", action="store_true",
                    help="random hidden states instead of the model body (for CPU runs; not with CUDA graphs)")
    ap.add_argument("--profile", default=None,
                    help="after timing, run --steps more steps under cProfile and write the stats here (.prof)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads when running on CPU (1: steadier timings on a shared machine)")
    ap.add_argument("--clock", choices=["wall", "thread"], default=None,
                    help="wall (default on CUDA) or this thread's CPU time (default on CPU: steady on a busy machine)")
    ap.add_argument("--cumulative", action="store_true",
                    help="step(final_only=False): a RequestOutput per request per step (streaming), "
                         "instead of LLM.generate's final-only")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="overlapped steps (the engine's default); --no-async-scheduling: synchronous steps")
    ap.add_argument("--output", default=None)
    ap.add_argument("--attention-layer", action="store_true",
                    help="time one eager attention layer's host wrappers instead (kernels stubbed)")
    args = ap.parse_args()
    if args.attention_layer:
        torch.set_num_threads(1)
        print(f"commit {git_commit()}, 20 decodes + a 300-token chunk, Triton launches stubbed, host us "
              f"per layer: write_kv + paged_attention {attention_layer_us()}, paged_attention alone "
              f"{attention_layer_us(write_kv=False)}")
        return
    git_commit()  # refuse before measuring, not after
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(args.cpu_threads)

    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_model
        model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny-llama"))
        load_format = args.load_format or "auto"
    else:
        model, load_format = args.model, args.load_format or "dummy"
    extra = {}
    for kv in shlex.split(args.engine_args):
        k, v = kv.split("=", 1)
        extra[k] = {"True": True, "False": False, "None": None}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    kwargs = dict(device=args.device, dtype=args.dtype, load_format=load_format, max_num_seqs=args.num_seqs,
                  skip_tokenizer_init=True, max_model_len=args.max_model_len,
                  async_scheduling=args.async_scheduling, **extra)
    engine = LLMEngine(make_engine_config(model, **kwargs))
    on_cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else None
    if args.stub_forward:
        _stub_forward(engine)

    n, max_len = args.num_seqs, engine.max_model_len
    final_only = not args.cumulative  # LLM.generate steps with final_only=True
    prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    lo, hi = prompt_bounds(prompt_len, max_len)
    ramp = fill_decode_batch(engine, n, prompt_len, BENCH_TEMPERATURE, final_only)
    for _ in range(args.warmup):
        engine.step(final_only=final_only)
    if not all_decoding(engine, n):
        raise RuntimeError("a sequence stopped during warm-up: lower --steps or raise --max-model-len")

    prepare_calls = _hook_prepare(engine)
    clock = {"wall": time.perf_counter, "thread": time.thread_time}[args.clock or ("wall" if on_cuda else "thread")]
    timer = StepTimer(sync, clock)
    before = {s.seq_id: len(s.output_token_ids) for g in engine.scheduler.running for s in g.seqs}
    engine.step_timer = timer
    for _ in range(args.steps):
        engine.step(final_only=final_only)
    engine.step_timer = NULL_STEP_TIMER
    after = {s.seq_id: len(s.output_token_ids) for g in engine.scheduler.running for s in g.seqs}
    if after.keys() != before.keys() or any(after[k] - before[k] != args.steps for k in before):
        raise RuntimeError("not every timed step was a full batch of decodes")
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step(final_only=final_only)
        prof.disable()
        prof.dump_stats(args.profile)
    gaps = busy = None
    if on_cuda:
        # No synchronization here: only the events, so the device waits exactly as it would unmeasured.
        gap_timer = StepTimer(None, time.perf_counter, gpu_gaps=True)
        engine.step_timer = gap_timer
        for _ in range(args.steps):
            engine.step(final_only=final_only)
        engine.step_timer = NULL_STEP_TIMER
        gaps, busy = gap_timer.gpu_gaps(), gap_timer.gpu_busy()

    recs = timer.records
    for r in recs:
        r["forward"] = r.pop("execute", 0.0)
    per_phase = {p: [r.get(p, 0.0) for r in recs] for p in ALL_PHASES}
    # Overlapped steps only launch the forward and the sampling: that is host time too.
    host_phases = HOST_PHASES + (("forward", "sample") if engine.async_scheduling else ())
    host = [sum(r.get(p, 0.0) for p in host_phases) for r in recs]
    total = [sum(r.values()) for r in recs]
    results = {
        "ms_per_decode_step_at_256" if n == 256 else f"ms_per_decode_step_at_{n}": _ms(host),
        "host_ms_mean": round(1e3 * statistics.fmean(host), 4),
        "sample_ms": _ms(per_phase["sample"]),
        "forward_ms": _ms(per_phase["forward"]),
        "step_ms": _ms(total),
        "breakdown_ms": {p: _ms(v) for p, v in per_phase.items()},
        "num_running_seqs": n,
        "timed_steps": args.steps,
        # False: the runner built its inputs some other way, and that time sits inside forward_ms.
        "prepare_split_measured": prepare_calls[0] >= args.steps,
        # The host time the GPU waits for, per decode step (CUDA events; None on the CPU).
        "gpu_idle_ms_per_decode_step": _ms(gaps) if gaps else None,
        "gpu_idle_ms_mean": round(1e3 * statistics.fmean(gaps), 4) if gaps else None,
        "gpu_busy_ms_per_step": _ms(busy) if busy else None,
        "host_phases": list(host_phases),
    }
    config = {"model": model if args.model else "tiny random llama (tests/tiny_models.py)",
              "load_format": load_format, "device": str(engine.device), "dtype": str(engine.dtype),
              "num_seqs": n, "prompt_len": [lo, hi], "temperature": BENCH_TEMPERATURE, "ignore_eos": True,
              "max_model_len": max_len, "stub_forward": args.stub_forward,
              "final_only": final_only, "async_scheduling": engine.async_scheduling,
              "clock": "wall" if clock is time.perf_counter else "thread", "warmup_steps": args.warmup, "ramp_steps": ramp, **extra}
    name = "host_overhead.json" if engine.async_scheduling else "host_overhead_sync.json"
    out = args.output or str(ROOT / "benchmarks/results" / ("h200" if on_cuda else "cpu") / name)
    command = "python benchmarks/offline/host_overhead.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ratios = {"host_share_of_step": round(sum(host) / sum(total), 4)}
    write_result(out, "host_overhead", command, config, results,
                 {"target_ms": 1.0, "target_gpu_idle_ms_per_decode_step": 0.3}, ratios,
                 switches=engine_switches(engine.config))
    print(f"host {results[next(iter(results))]:.3f} ms/step (median of {args.steps}) at {n} running seqs, "
          f"async_scheduling={engine.async_scheduling}")
    if gaps:
        print(f"  GPU idle between steps (host time the GPU waits for): "
              f"{results['gpu_idle_ms_per_decode_step']:.3f} ms median, {results['gpu_idle_ms_mean']:.3f} ms mean; "
              f"GPU busy {results['gpu_busy_ms_per_step']:.3f} ms/step")
    for p in ALL_PHASES:
        print(f"  {p:12s} {results['breakdown_ms'][p]:9.3f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
