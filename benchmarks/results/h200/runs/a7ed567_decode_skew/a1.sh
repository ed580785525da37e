#!/usr/bin/env bash
# balanced decode splits: attention GPU tests, the skew microbenchmark (modes and resident sweep),
# then the engine GPU tests with the switch on (greedy = HF, graphs, warm-up).
source .gpu/common.sh
P "start"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_gpu.py -x > $OUT/gpu_attn.log 2>&1
P "attention gpu tests rc=$?"; tail -2 $OUT/gpu_attn.log
timeout 150 python3 benchmarks/decode_skew.py --num-seqs 16 32 64 96 128 192 256 \
  --split-tokens 0 1024 balanced balanced@132 balanced@396 balanced@528 --output $OUT/decode_skew.json > $OUT/decode_skew.log 2>&1
P "skew rc=$?"; cut -c1-600 $OUT/decode_skew.log
PAGEDSERVE_DECODE_SPLIT_TOKENS=balanced timeout 240 python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda_graph_sizes.py \
  tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py tests/runner/test_warmup_gpu.py \
  tests/engine/test_cuda_piecewise.py > $OUT/gpu_engine_balanced.log 2>&1
P "engine gpu tests (balanced) rc=$?"; tail -3 $OUT/gpu_engine_balanced.log
