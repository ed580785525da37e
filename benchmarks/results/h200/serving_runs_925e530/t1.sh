#!/usr/bin/env bash
# chunk c9, then the GPU tests of the new decode defaults (attention kernels; engine: graphs, greedy = HF)
bash .gpu/chunk.sh c9
source .gpu/common.sh
P "start t1"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/runner/test_cuda_graph_sizes.py \
  tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py tests/runner/test_warmup_gpu.py \
  tests/engine/test_cuda_piecewise.py tests/engine/test_step_trace.py > $OUT/gpu_engine.log 2>&1
P "engine gpu tests rc=$?"; tail -3 $OUT/gpu_engine.log
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/attention/test_triton_gpu.py > $OUT/gpu_attn.log 2>&1
P "attention gpu tests rc=$?"; tail -3 $OUT/gpu_attn.log
