"""`python -m pagedserve.runner.launch`: run this process as tensor-parallel rank RANK > 0.

Rank 0 (an `LLM(..., tensor_parallel_size=N)` or `pagedserve serve --tensor-parallel-size N`)
starts its workers with this module on loopback; across machines, torchrun (or any launcher
that sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK) starts it on each node.
A worker needs no arguments: rank 0 sends it the engine configuration and every step's plan.
"""
from __future__ import annotations

import os
import sys

PARENT_PID_ENV = "PAGEDSERVE_TP_PARENT_PID"
NUM_THREADS_ENV = "PAGEDSERVE_TP_NUM_THREADS"


def main() -> int:
    import faulthandler
    import signal
    # Rank 0's watchdog sends SIGUSR1 before it kills a stuck rank: every thread's stack goes to
    # stderr, so the report shows where the rank was stuck. Registered first: until then SIGUSR1 kills.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from pagedserve.runner.dist_env import torchrun_env
    from pagedserve.runner.tp_startup import STARTUP_DIR_ENV, StartupTrace
    env = torchrun_env()
    if env is None or env.rank == 0:
        print("pagedserve.runner.launch runs ranks > 0: set MASTER_ADDR, MASTER_PORT, WORLD_SIZE >= 2 "
              "and RANK >= 1 (torchrun does); rank 0 is the engine itself", file=sys.stderr)
        return 2
    trace = StartupTrace(env.rank, os.environ.get(STARTUP_DIR_ENV))
    trace.arm_stack_dump()  # disarmed when the first start-up phase begins (tp_worker.Worker.dispatch)
    trace.step("start", f"pid {os.getpid()}")
    trace.step("import torch")
    import torch
    if os.environ.get(NUM_THREADS_ENV):
        torch.set_num_threads(int(os.environ[NUM_THREADS_ENV]))
    from pagedserve.runner.tp_worker import run_worker
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        # Spawned by rank 0, in its process group: Ctrl-C is rank 0's to handle (it stops us cleanly).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return run_worker(env, int(parent) if parent else None, trace)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit handlers of libraries that could block on a broken group
