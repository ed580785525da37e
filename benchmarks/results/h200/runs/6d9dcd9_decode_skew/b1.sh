#!/usr/bin/env bash
# balanced decode splits on by default: the skew microbenchmark (auto = the graph's pick), the
# attention GPU tests, the engine GPU tests (greedy = HF, both graphs, no compile after start).
source .gpu/common.sh
P "start"
timeout 120 python3 benchmarks/decode_skew.py --num-seqs 16 24 32 48 64 96 128 192 256 \
  --split-tokens 0 1024 balanced auto balanced@792 --output $OUT/decode_skew.json > $OUT/decode_skew.log 2>&1
P "skew rc=$?"; grep -v "^{" $OUT/decode_skew.log | cut -c1-700
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda_graph_sizes.py \
  tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py tests/runner/test_warmup_gpu.py \
  tests/runner/test_release_graphs.py tests/engine/test_cuda_piecewise.py tests/engine/test_step_trace.py > $OUT/gpu_engine.log 2>&1
P "engine gpu tests rc=$?"; tail -3 $OUT/gpu_engine.log
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_gpu.py > $OUT/gpu_attn.log 2>&1
P "attention gpu tests rc=$?"; tail -3 $OUT/gpu_attn.log
