#!/usr/bin/env bash
# FP8 on the H200, one section per device command (each < 10 min): run from the repo root.
#   bash benchmarks/fp8_h200.sh tests|fixed256|nanovllm|trtllm128|trtllm2048|cap_bf16|cap_fp8|accuracy|fused|kvhead|gemm|gemm_tune|kvdecode
#   SITE=/path/to/vllm-site bash benchmarks/fp8_h200.sh vllm_offline|online
# vllm_offline = vLLM 0.26 FP8 on Llama-3.1-8B: nanovllm (its prompts and lengths, on OUR model: bench_vllm's
# nanovllm defaults to Qwen3-0.6B, so --config is required) and 128/2048, one start-up (~6 min); it writes
# vllm_fp8_<workload>.json into $OUT: copy them into $P before collect.
# online = both OpenAI servers with the FP8 switches, sharegpt-like at 10/20/40 req/s (~8 min); then
# `python benchmarks/serving/vs_vllm.py collect --work $P/online --rates 10 20 40 --output $P/online_fp8.json`.
# gemm = the Triton W8A8 GEMM: its GPU tests, then benchmarks/kernels/fp8_gemm_ab.py (against cuBLASLt
# at Llama-3.1-8B's shapes, 1-4096 tokens).
# gemm_tune = benchmarks/kernels/tune_fp8_gemm.py first (writes the tables into
# pagedserve/layers/quant/configs/, where the kernel reads them, and copies them to $P/configs: commit
# those; it times CUDA graph replays, benchmarks/kernels/graph_timing.py), then the GEMM's GPU tests (and the
# timer's fallback) and the A/B with the tables in place (< 10 min in all: 180 + 170 + 230 s at most).
# kvhead = per-KV-head KV scales: their GPU tests, then benchmarks/kernels/fp8_kv_scales.py (the cache
# write, decode and prefill kernels with per-tensor vs per-head scales).
# kvdecode = the FP8 KV decode kernel's own launch: its GPU tests (the launch variants against the reference, in a
# CUDA graph, and no compile after start-up with PAGEDSERVE_DECODE_LAUNCH_FP8 set; ~2 min), then
# benchmarks/kernels/fp8_decode_sweep.py (BLOCK_N x warps x stages x the f16 cast at 4 batch x context shapes,
# beside bf16; < 3 min): its best launch per shape is the candidate for decode_plan.DECODE_FP8_LAUNCH.
# fused = the activation quantization fused into the norms / SiLU-and-mul: its GPU tests, then
# benchmarks/kernels/fp8_fused_quant.py (kernels and a Llama-3.1-8B decode step, fusion on/off).
# Parts land in benchmarks/results/h200/fp8_parts/ (and are copied to $OUT when set); once all are
# back in the checkout, `python benchmarks/offline/fp8_bench.py collect` (CPU is fine) writes
# benchmarks/results/h200/fp8.json. A tree copied without .git needs the stamp first:
# `python -m pagedserve.benchmark.results stamp` in the checkout (benchmarks/h200_run.sh says why).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keep a site dir of the server wheels
P=benchmarks/results/h200/fp8_parts
mkdir -p $P
FP8="--quantization fp8 --kv-cache-dtype fp8"
case "${1:-}" in
  tests) timeout 580 python3 -m pytest -q -p no:cacheprovider tests/attention/test_fp8_gpu.py \
           tests/attention/test_triton_gpu.py tests/engine/test_cuda_engine.py 2>&1 | tee $P/gpu_tests.log | tail -40 ;;
  fixed256) timeout 590 python3 -m pagedserve.entrypoints.cli bench throughput --workload fixed256 $FP8 \
              --output $P/fixed256_fp8.json ;;
  nanovllm) timeout 590 python3 -m pagedserve.entrypoints.cli bench throughput --workload nanovllm \
              --model benchmarks/models/llama-3.1-8b $FP8 --output $P/nanovllm_fp8.json ;;
  trtllm128) timeout 590 python3 benchmarks/offline/fp8_bench.py trtllm 128_128 --parts $P ;;
  trtllm2048) timeout 590 python3 benchmarks/offline/fp8_bench.py trtllm 128_2048 --parts $P ;;
  cap_bf16) timeout 590 python3 benchmarks/offline/fp8_bench.py capacity auto --parts $P ;;
  cap_fp8) timeout 590 python3 benchmarks/offline/fp8_bench.py capacity fp8 --parts $P ;;
  accuracy) timeout 590 python3 benchmarks/offline/fp8_accuracy.py --device cuda --output $P/fp8_accuracy_h200.json ;;
  fused) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fp8_fused_gpu.py 2>&1 \
           | tee $P/fused_gpu_tests.log | tail -30
         timeout 380 python3 benchmarks/kernels/fp8_fused_quant.py --output $P/fp8_fused_quant.json ;;
  kvhead) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/attention/test_fp8_gpu.py \
            -k "per_head or perplexity or graphs" 2>&1 | tee $P/kv_per_head_gpu_tests.log | tail -30
          timeout 180 python3 benchmarks/kernels/fp8_kv_scales.py --output $P/fp8_kv_scales.json ;;
  gemm) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/quant/test_fp8_gemm_gpu.py 2>&1 \
          | tee $P/gemm_gpu_tests.log | tail -30
        timeout 300 python3 benchmarks/kernels/fp8_gemm_ab.py --output $P/fp8_gemm_ab.json ;;
  kvdecode) timeout 340 python3 -m pytest -q -p no:cacheprovider tests/attention/test_fp8_gpu.py \
              tests/runner/test_warmup_gpu.py -k "launch" 2>&1 | tee $P/kvdecode_gpu_tests.log | tail -30
            timeout 200 python3 benchmarks/kernels/fp8_decode_sweep.py --output $P/fp8_decode_sweep.json ;;
  vllm_offline) PYTHONPATH=${SITE:?set SITE to the dir vLLM 0.26 is installed in} VLLM_USE_FLASHINFER_SAMPLER=0 \
                timeout 590 python3 benchmarks/serving/peers/bench_vllm.py --workload nanovllm --also trtllm_128_2048 \
                --config benchmarks/models/llama-3.1-8b/config.json --quantization fp8 --kv-cache-dtype fp8 --tag fp8 ;;
  online) VLLM_USE_FLASHINFER_SAMPLER=0 timeout 590 python3 benchmarks/serving/vs_vllm.py online \
            --site "${SITE:?set SITE to the dir vLLM 0.26 is installed in}" --work $P/online --rates 10 20 40 \
            --pagedserve-args "$FP8" --vllm-args "$FP8" ;;
  gemm_tune) timeout 180 python3 benchmarks/kernels/tune_fp8_gemm.py --max-seconds 140 2>&1 | tee $P/fp8_gemm_tune.log | tail -20
             mkdir -p $P/configs && cp pagedserve/layers/quant/configs/N=*.json $P/configs/
             timeout 170 python3 -m pytest -q -p no:cacheprovider tests/quant/test_fp8_gemm_gpu.py \
               tests/quant/test_tune_tables.py 2>&1 | tee $P/gemm_gpu_tests.log | tail -30
             timeout 230 python3 benchmarks/kernels/fp8_gemm_ab.py --output $P/fp8_gemm_ab.json ;;
  *) echo "usage: $0 tests|fixed256|nanovllm|trtllm128|trtllm2048|cap_bf16|cap_fp8|accuracy|fused|kvhead|gemm|gemm_tune|kvdecode|vllm_offline|online" >&2; exit 2 ;;
esac
rc=$?
[ -n "${OUT:-}" ] && cp -r $P "$OUT/" 2>/dev/null
exit $rc
