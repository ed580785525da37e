"""Benchmark harness used by `pagedserve bench` and the scripts under benchmarks/."""
