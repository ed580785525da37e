#!/usr/bin/env bash
# Every H200 figure in benchmarks/results/h200/. Run from the repo root on the GPU machine:
#   bash benchmarks/h200_run.sh throughput|paper|paper2|memory|perf|hf_full|session
# A copy of the tree without .git must carry pagedserve/_build_commit.json (git-ignored), written in
# the checkout by `python -m pagedserve.benchmark.results stamp`; without it every result refuses.
# perf = GPU tests, decode profile and host overhead with the fused layer ops on and off, nanovllm.
# hf_full = HF generate on the whole nanovllm workload beside pagedserve's runs (results/h200/hf_full/).
# paper = serving_load, paper2 = block_size + swap_vs_recompute + shared_prefix, memory = Figure 2
# on the GPU engine beside the sim; session = GPU tests, paper2, paper, memory, throughput one
# after another (about 20 min): start it detached
# (`setsid nohup ... &`) and collect over several device calls, since one call lasts 10 min.
# Each step logs and carries on, so one failure does not lose the other figures; logs/progress.log
# says when each step started and ended, and logs/DONE appears at the end.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=benchmarks/results/h200
mkdir -p $R logs
step() {  # step NAME SECONDS CMD...: run with a time limit, log to logs/NAME.log
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> logs/progress.log
  timeout "$limit" "$@" > "logs/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$?" >> logs/progress.log
}
gpu_tests() { step gpu_tests 240 python3 -m pytest -q tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py; }
paper() { step paper_gpu 1200 python3 benchmarks/paper/paper_gpu.py --sections serving_load; }
paper2() { step paper_gpu2 900 python3 benchmarks/paper/paper_gpu.py --sections block_size,shared_prefix --bs-requests 100; }
memory() { step paper_gpu_memory 300 python3 benchmarks/paper/paper_gpu.py --sections memory; }
throughput() {
  step nanovllm 240 python3 benchmarks/offline/run_throughput.py --workload nanovllm --hf-requests 128 --hf-max-new-tokens 128
  step host_overhead 120 python3 benchmarks/offline/host_overhead.py --model benchmarks/models/qwen3-0.6b --max-model-len 4096 \
    --steps 50 --output $R/host_overhead.json
  step fixed256 240 python3 benchmarks/offline/run_throughput.py --workload fixed256 --hf-requests 128 --hf-max-new-tokens 64
}
perf() {
  step gpu_tests 240 python3 -m pytest -q tests/layers/test_fused_gpu.py tests/engine/test_cuda_engine.py \
    tests/runner/test_cuda_runner.py
  # Fused ops broken on this GPU: measure the rest without them, and say so in the log.
  grep -q " failed" logs/gpu_tests.log && export PAGEDSERVE_FUSED=0 && echo "PAGEDSERVE_FUSED=0" >> logs/progress.log
  step profile_decode 180 python3 benchmarks/kernels/profile_decode.py
  step host_overhead 120 python3 benchmarks/offline/host_overhead.py --model benchmarks/models/qwen3-0.6b --max-model-len 4096 \
    --steps 50 --output $R/host_overhead.json
  PAGEDSERVE_FUSED=0 step host_overhead_unfused 120 python3 benchmarks/offline/host_overhead.py \
    --model benchmarks/models/qwen3-0.6b --max-model-len 4096 --steps 50 --output $R/host_overhead_unfused.json
  step nanovllm 240 python3 benchmarks/offline/run_throughput.py --workload nanovllm --hf-requests 128 --hf-max-new-tokens 128 \
    --hf-modes generate
  step fixed256 240 python3 benchmarks/offline/run_throughput.py --workload fixed256 --hf-requests 128 --hf-max-new-tokens 64 \
    --hf-modes generate
}
case ${1:-throughput} in
  throughput) gpu_tests; step paged_decode 120 python3 benchmarks/kernels/bench_paged_decode.py --skip sweep \
                --output $R/paged_decode.json; throughput ;;
  paper) paper ;;
  paper2) paper2 ;;
  memory) memory ;;
  perf) perf ;;
  hf_full) step nanovllm_hf_full 540 python3 benchmarks/offline/run_throughput.py --workload nanovllm --hf-modes generate \
             --out-dir $R/hf_full ;;
  session) gpu_tests; paper2; paper; memory; throughput ;;
esac
touch logs/DONE
for f in logs/*.log; do echo "== $f"; tail -n 3 "$f"; done
