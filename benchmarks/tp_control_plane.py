"""How long rank 0's per-step command takes to reach the other tensor-parallel ranks.

Every TP step, rank 0 broadcasts the step's inputs (a pickled Command holding the StepInput: token
ids, positions, block tables, ...) over the gloo control group, and the other ranks start their
forward only once it has arrived (runner/executor.py collective_rpc, runner/tp_worker.py). This
times exactly that broadcast for a decode step of --num-seqs sequences, each with a block table of
--blocks-per-seq blocks, between two local processes: the fixed per-step cost the control plane
adds to a TP>1 step, whatever the GPU does. CPU only (gloo over loopback, as on one GPU host).

    python benchmarks/tp_control_plane.py --output benchmarks/results/cpu/tp_control_plane.json
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


def worker(rank: int, port: int, args, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cmd = make_command(args.num_seqs, args.blocks_per_seq, args.block_size) if rank == 0 else None
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
    args = ap.parse_args()
    from pagedserve.runner.dist_env import free_port
    size = len(pickle.dumps(make_command(args.num_seqs, args.blocks_per_seq, args.block_size)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    med = {f"rank{r}_ms_median": round(statistics.median(t), 3) for r, t in sorted(got.items())}
    p90 = {f"rank{r}_ms_p90": round(sorted(t)[int(0.9 * len(t))], 3) for r, t in sorted(got.items())}
    results = {"pickled_bytes": size, **med, **p90, "cpu_count": os.cpu_count()}
    print(results)
    if args.output:
        from pagedserve.benchmark.results import write_result
        write_result(Path(args.output), "tp_control_plane", "python benchmarks/tp_control_plane.py " + " ".join(sys.argv[1:]),
                     vars(args), results, {}, {"step_command_ms_median_rank1": med["rank1_ms_median"]}, device="cpu")


if __name__ == "__main__":
    main()
