"""How long rank 0's per-step command takes to reach the other tensor-parallel ranks.

Every TP step, rank 0 broadcasts the step's inputs (a pickled Command holding the StepInput: token
ids, positions, block tables, ...) over the gloo control group, and the other ranks start their
forward only once it has arrived (runner/executor.py collective_rpc, runner/tp_worker.py). This
times exactly that broadcast for a decode step of --num-seqs sequences, each with a block table of
--blocks-per-seq blocks, between two local processes: the fixed per-step cost the control plane
adds to a TP>1 step, whatever the GPU does. CPU only (gloo over loopback, as on one GPU host).

    python benchmarks/tp_control_plane.py --output benchmarks/results/cpu/tp_control_plane.json

--from-engine takes the commands from a real TP=2 engine on CPU instead (the bundled demo model,
--num-seqs prompts of about --blocks-per-seq full blocks each, decoding together), once with the
incremental device inputs (PAGEDSERVE_INCREMENTAL_INPUTS=1: a decode step sends the rows and
what changed) and once with every table rebuilt (=0), and times the median decode-step command
of each the same way.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_command(num_seqs: int, blocks_per_seq: int, block_size: int):
    from pagedserve.runner.batch import HostBatch
    from pagedserve.runner.model_runner import StepInput
    from pagedserve.runner.tp_worker import Command
    rng = np.random.default_rng(0)
    starts = rng.integers(block_size * (blocks_per_seq - 1), block_size * blocks_per_seq, size=num_seqs)
    tables = [rng.integers(0, 50_000, size=blocks_per_seq).tolist() for _ in range(num_seqs)]
    batch = HostBatch(rng.integers(0, 128_000, size=num_seqs), starts, np.ones(num_seqs, dtype=np.int64), tables,
                      np.ones(num_seqs, dtype=bool), num_seqs, None, None)
    return Command("execute_model", (StepInput([], [], [], batch),), {}, False, 1)


def engine_commands(num_seqs: int, blocks_per_seq: int, block_size: int) -> None:
    """In a subprocess (PAGEDSERVE_INCREMENTAL_INPUTS set by the caller): run a TP=2 demo engine and
    print the pickled size of every decode-only step command that ran all num_seqs sequences,
    then the median one itself (hex), for the parent to time."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.runner import executor
    seen: list[bytes] = []
    real_control = executor._control

    def recording(op, *a, **kw):
        box = a[0] if a else None
        if op is dist.broadcast_object_list and box and getattr(box[0], "method", None) == "execute_model":
            step = box[0].args[0]
            b = step.batch
            if b is not None and b.num_decodes == num_seqs == len(b.input_ids):
                seen.append(pickle.dumps(box[0]))
        return real_control(op, *a, **kw)
    executor._control = recording
    llm = LLM(str(ROOT / "pagedserve/demo_model"), device="cpu", tensor_parallel_size=2, block_size=block_size,
              max_num_seqs=num_seqs, num_gpu_blocks_override=num_seqs * (blocks_per_seq + 4), seed=0)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 2000, size=blocks_per_seq * block_size - 8).tolist()}
               for _ in range(num_seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    llm.llm_engine.shutdown()
    sizes = sorted(len(x) for x in seen)
    median = sorted(seen, key=len)[len(seen) // 2]
    print("SIZES", " ".join(map(str, sizes)))
    print("MEDIAN", median.hex())


def from_engine(args, incremental: str) -> tuple[bytes, list[int]]:
    import subprocess
    env = dict(os.environ, PAGEDSERVE_INCREMENTAL_INPUTS=incremental, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, __file__, "--engine-child", "--num-seqs", str(args.num_seqs),
                          "--blocks-per-seq", str(args.blocks_per_seq), "--block-size", str(args.block_size)],
                         env=env, capture_output=True, text=True, timeout=900, check=True).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("SIZES ", "MEDIAN ")))
    return bytes.fromhex(lines["MEDIAN"]), [int(x) for x in lines["SIZES"].split()]


def time_broadcast(args, payload: bytes | None) -> dict:
    """Median/p90 ms of broadcasting the command (payload: a pickled one; None: make_command's)."""
    from pagedserve.runner.dist_env import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue, payload)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    med = {f"rank{r}_ms_median": round(statistics.median(t), 3) for r, t in sorted(got.items())}
    p90 = {f"rank{r}_ms_p90": round(sorted(t)[int(0.9 * len(t))], 3) for r, t in sorted(got.items())}
    return {**med, **p90}


def worker(rank: int, port: int, args, queue, payload: bytes | None = None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cmd = None
    if rank == 0:
        cmd = pickle.loads(payload) if payload else make_command(args.num_seqs, args.blocks_per_seq, args.block_size)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()  # both sides ready: the time is the broadcast alone, as in a step
        t0 = time.perf_counter()
        box = [cmd if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 1:
            assert box[0].method == "execute_model"
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    queue.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--blocks-per-seq", type=int, default=24, help="fixed256 mid-run: ~380 tokens / 16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--output", default=None)
    ap.add_argument("--from-engine", action="store_true", help="the commands of a real TP=2 demo engine, "
                    "incremental inputs on and off")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_child:
        engine_commands(args.num_seqs, args.blocks_per_seq, args.block_size)
        return
    if args.from_engine:
        results = {"cpu_count": os.cpu_count()}
        for name, flag in (("incremental", "1"), ("full_tables", "0")):
            payload, sizes = from_engine(args, flag)
            results[name] = {"decode_steps_seen": len(sizes), "pickled_bytes_median": len(payload),
                             "pickled_bytes_min": sizes[0], "pickled_bytes_max": sizes[-1],
                             **time_broadcast(args, payload)}
        med = {"rank1_ms_median": results["incremental"]["rank1_ms_median"]}
    else:
        size = len(pickle.dumps(make_command(args.num_seqs, args.blocks_per_seq, args.block_size)))
        timed = time_broadcast(args, None)
        results = {"pickled_bytes": size, **timed, "cpu_count": os.cpu_count()}
        med = {"rank1_ms_median": timed["rank1_ms_median"]}
    print(results)
    if args.output:
        from pagedserve.benchmark.results import write_result
        write_result(Path(args.output), "tp_control_plane", "python benchmarks/tp_control_plane.py " + " ".join(sys.argv[1:]),
                     vars(args), results, {}, {"step_command_ms_median_rank1": med["rank1_ms_median"]}, device="cpu")


if __name__ == "__main__":
    main()
