#!/usr/bin/env bash
# Every H200 figure in benchmarks/results/h200/, in two phases that fit the device tool's
# 10-minute calls. Run from the repo root on the GPU machine:
#   PAGEDSERVE_COMMIT=<sha> bash benchmarks/h200_run.sh throughput|paper|paper2
# Each step logs and carries on, so one failure does not lose the other figures.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=benchmarks/results/h200
mkdir -p $R logs
phase=${1:-throughput}
if [ "$phase" = throughput ]; then
  timeout 120 python3 -m pytest -q tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py 2>&1 | tail -5 | tee logs/gpu_tests.log
  timeout 120 python3 benchmarks/bench_paged_decode.py --skip sweep --output $R/paged_decode.json > logs/paged_decode.log 2>&1
  timeout 200 python3 benchmarks/run_throughput.py --workload nanovllm --hf-requests 128 --hf-max-new-tokens 128 > logs/nanovllm.log 2>&1
  timeout 220 python3 benchmarks/run_throughput.py --workload fixed256 --hf-requests 128 --hf-max-new-tokens 64 > logs/fixed256.log 2>&1
  timeout 90 python3 benchmarks/host_overhead.py --model benchmarks/models/qwen3-0.6b --max-model-len 4096 --steps 50 --output $R/host_overhead.json > logs/host_overhead.log 2>&1
elif [ "$phase" = paper ]; then
  timeout 560 python3 benchmarks/paper_gpu.py --sections serving_load --rates 4,8,16,32 --num-requests 100 > logs/paper_gpu.log 2>&1
else  # paper2: too long to share a call with serving_load (the first run of both together hit the limit)
  timeout 560 python3 benchmarks/paper_gpu.py --sections block_size,shared_prefix --bs-requests 100 > logs/paper_gpu2.log 2>&1
fi
for f in logs/*.log; do tail -n 3 "$f"; done
