"""Kernel timing as serving pays it: launches captured in one CUDA graph, replayed, microseconds
per launch. Shared by the kernel benchmarks (decode_skew.py, fp8_gemm_ab.py, ...) and the tuners
(tune_fp8_gemm.py, tune_fused_moe.py).

Why graphs: decode steps replay CUDA graphs, so serving never pays a kernel's host launch cost
(Python, Triton's launcher: tens of microseconds). triton.testing.do_bench times one launch at a
time from Python, and for a kernel of 5-50 us (a GEMM at 1-64 tokens) that host cost shows in the
time: on the H200 (2026-12-02) do_bench had the Triton W8A8 GEMM at 36-43 us on o_proj at 1-64
tokens, cuBLASLt at 17 us, where graphs had Triton at 0.64-0.97x cuBLASLt's time.

Why copies: a decode step's layers each read their own weights, so a kernel finds its weight in
HBM, not in L2. A graph that runs one launch per copy (cold_copies), WEIGHT_BYTES_PER_GRAPH bytes
in all (5x the H200's 50 MB L2), gives every launch that cost, as do_bench's L2 flush did.

Fallback: a launch that cannot be captured (it syncs or reads on the host) is timed by do_bench,
and timed_us says which timing it got ("graph" | "launch"); fastest() never lets a launch-timed
candidate beat a graph-timed one: its time carries host cost the others do not, and it could not
run inside serving's graphs either.
"""
from __future__ import annotations

import itertools
import statistics

import torch
import triton.testing

WEIGHT_BYTES_PER_GRAPH = 256 << 20
MAX_COPIES = 64  # a small weight: the graph's launches, not its bytes, bound the copies


def copies_for(nbytes: int) -> int:
    """How many copies of nbytes reach WEIGHT_BYTES_PER_GRAPH (1 to MAX_COPIES)."""
    return max(1, min(MAX_COPIES, -(-WEIGHT_BYTES_PER_GRAPH // max(1, nbytes))))


def cold_copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """`tensors` (a weight and its scales) and clones of them, copies_for their bytes in all: a
    graph that launches once per copy reads each launch's weight from HBM."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies_for(nbytes) - 1)]


def graph_us_per_launch(launch, replays: int, launches: int = 32) -> float:
    """Median microseconds per launch of `launches` calls of launch() (one per layer) captured in
    one CUDA graph, over `replays` replays; compiled outside the capture first."""
    launch()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times)


def graph_us_per_copy(fn, copies: list, replays: int = 20) -> float:
    """Median microseconds per launch of a graph that runs fn(copy) once per copy."""
    cycle = itertools.cycle(copies)
    return graph_us_per_launch(lambda: fn(next(cycle)), replays, launches=len(copies))


def launch_us(fn, rep_ms: int = 10) -> float:
    """do_bench's median microseconds of fn(), one launch at a time, L2 flushed before each."""
    return 1e3 * triton.testing.do_bench(fn, warmup=1, rep=rep_ms, return_mode="median")


def timed_us(fn, copies: list, graph: bool = True, replays: int = 20, rep_ms: int = 10) -> tuple[float, str]:
    """(us per launch, "graph") from graph_us_per_copy; (launch_us of fn(copies[0]), "launch")
    where graph is False or the capture fails. An error of fn itself (a config that does not
    compile, or runs out of shared memory) is raised, not taken for a capture failure."""
    if graph:
        fn(copies[0])  # compile and run once outside any capture: fn's own errors surface here
        try:
            return graph_us_per_copy(fn, copies, replays), "graph"
        except Exception as e:  # noqa: BLE001  (not capturable: time it as it launches, and say so)
            print(f"  graph capture failed ({type(e).__name__}: {str(e)[:120]}): timing launches", flush=True)
            # torch.cuda.graph's exit raises before it leaves its capture stream: back to the default one.
            torch.cuda.set_stream(torch.cuda.default_stream())
            torch.cuda.synchronize()
    return launch_us(lambda: fn(copies[0]), rep_ms), "launch"


def fastest(timed: list[tuple[dict, float, str]]) -> tuple[dict, float, str] | None:
    """The fastest (config, us, timing) of `timed`, graph-timed ones first (module docstring);
    the first listed among equal times; None when empty."""
    if not timed:
        return None
    return min(timed, key=lambda t: (t[2] != "graph", t[1]))
