#!/usr/bin/env bash
# chunk c9, then the engine GPU tests (graphs, piecewise, short prefills as decode rows, greedy = HF)
bash .gpu/chunk.sh c9
source .gpu/common.sh
P "start t2"
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_piecewise.py \
  tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py tests/runner/test_cuda_graph_sizes.py \
  tests/runner/test_release_graphs.py tests/engine/test_step_trace.py > $OUT/gpu_engine.log 2>&1
P "engine gpu tests rc=$?"; tail -5 $OUT/gpu_engine.log
