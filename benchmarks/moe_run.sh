#!/usr/bin/env bash
# The MoE GPU work (issue #33), one section per call (each fits a 10-minute device call):
#   bash benchmarks/moe_run.sh tests|layer|steps
#   bash benchmarks/moe_run.sh tune_qwen|tune_mixtral [bfloat16|fp8_w8a8|all]   (default bfloat16; ~4 min each)
#   bash benchmarks/moe_run.sh fp8                       (FP8 MoE GPU tests, then the layer FP8 vs bf16, batch 1..256)
#   bash benchmarks/moe_run.sh offline MODEL WORKLOAD   (qwen3-30b-a3b|mixtral-8x7b, nanovllm|fixed256)
#   bash benchmarks/moe_run.sh ep_layer                  (one GPU: a rank's share at TP=2, sharded vs whole experts)
#   bash benchmarks/moe_run.sh ep MODEL WORKLOAD         (two GPUs: TP=2 sharded vs expert parallel, into moe.json)
# Results and logs go under ${OUT:-benchmarks/results/h200}; tuned tables are written into
# $OUT/configs/ (commit them from there into pagedserve/layers/fused_moe/configs/) and copied into
# that directory of the device's tree, so later sections of the same session use them.
# Like h200_run.sh: a tree without .git needs pagedserve/_build_commit.json for result files.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keep a vLLM site (layer --vllm)
O=${OUT:-benchmarks/results/h200}
mkdir -p "$O/logs"
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> "$O/logs/progress.log"
  timeout "$limit" "$@" > "$O/logs/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$?" >> "$O/logs/progress.log"
}
case "${1:-}" in
  tests) step moe_kernel_tests 250 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fused_moe_gpu.py
         step moe_model_tests 310 python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda_runner.py \
           tests/engine/test_cuda_engine.py tests/runner/test_warmup_gpu.py -k "moe or mixtral" ;;
  tune_qwen|tune_mixtral)
    model=$([ "$1" = tune_qwen ] && echo qwen3-30b-a3b || echo mixtral-8x7b)
    dtypes=${2:-bfloat16}; [ "$dtypes" = all ] && dtypes="bfloat16 fp8_w8a8"
    mkdir -p "$O/configs"
    for dt in $dtypes; do  # each: --max-seconds 200 stops starting token counts; 270 s hard limit
      step "tune_${model//-/_}_$dt" 270 python3 benchmarks/kernels/tune_fused_moe.py --model "$model" --dtype "$dt" \
        --max-seconds 200 --output-dir "$O/configs"
    done
    cp "$O"/configs/E=*.json pagedserve/layers/fused_moe/configs/ 2>/dev/null ;;
  fp8) step moe_fp8_tests 300 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fused_moe_fp8_gpu.py
       step moe_fp8_layer 250 python3 benchmarks/kernels/bench_fused_moe.py --models qwen3-30b-a3b --fp8 \
         --batches 1 2 4 8 16 32 64 128 256 --output "$O/moe_fp8_layer.json" ;;
  layer) step moe_layer 560 python3 benchmarks/kernels/bench_fused_moe.py ${VLLM:+--vllm} --output "$O/moe_layer.json" ;;
  offline) step "moe_offline_$2_$3" 580 python3 benchmarks/offline/moe_offline.py --models "$2" --workloads "$3" --merge \
             ${VLLM_DIR:+--vllm-dir $VLLM_DIR} --output "$O/moe.json" ;;
  steps) step moe_offline_steps 560 python3 benchmarks/offline_steps.py --workload nanovllm \
           --model benchmarks/models/qwen3-30b-a3b --output "$O/offline_steps_qwen3_30b_a3b.json" ;;
  ep_layer) step moe_layer_tp2 280 python3 benchmarks/kernels/bench_fused_moe.py --tp 2 --output "$O/moe_layer_tp2.json"
            step moe_layer_tp2_ep 280 python3 benchmarks/kernels/bench_fused_moe.py --tp 2 --expert-parallel \
              --output "$O/moe_layer_tp2_ep.json" ;;
  ep) step "moe_offline_$2_$3_tp2" 290 python3 benchmarks/offline/moe_offline.py --models "$2" --workloads "$3" --merge \
        --tag tp2 --engine-args "--tensor-parallel-size 2" --output "$O/moe.json"
      step "moe_offline_$2_$3_tp2_ep" 290 python3 benchmarks/offline/moe_offline.py --models "$2" --workloads "$3" --merge \
        --tag tp2_ep --engine-args "--tensor-parallel-size 2 --enable-expert-parallel" --output "$O/moe.json" ;;
  *) echo "usage: $0 tests|tune_qwen [DTYPE]|tune_mixtral [DTYPE]|fp8|layer|steps, or offline MODEL WORKLOAD" >&2; exit 2 ;;
esac
tail -3 "$O/logs/progress.log"
