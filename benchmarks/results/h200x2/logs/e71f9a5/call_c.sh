#!/usr/bin/env bash
# Call C (2xH200), the last: [GPU0 TTFT tail re-check | GPU1 release-graphs test, decode kernel, host overhead] then TP=1 vs TP=2 and serve --tp 2.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:/tmp/site
W=$(mktemp -d); mkdir -p $W/ttft $W/one $W/tp
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
P start
( CUDA_VISIBLE_DEVICES=0 PAGEDSERVE_LOG_PAUSES_MS=50 timeout ${T1:-150} python3 benchmarks/vs_vllm.py online --engines pagedserve --gpus 0 --site /tmp/site --work $W/ttft --rates 20 40 --startup-limit 120 --rate-limit 60 > $W/ttft/run.log 2>&1; P "ttft rc=$?" ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 40 python3 -m pytest -q -p no:cacheprovider tests/runner/test_release_graphs.py > $W/one/release_test.log 2>&1; P "release test rc=$?"
  timeout 60 python3 benchmarks/bench_paged_decode.py --skip sweep --output $W/one/paged_decode.json > $W/one/kernel.log 2>&1; P "kernel rc=$?"
  timeout 60 python3 benchmarks/host_overhead.py --model benchmarks/models/qwen3-0.6b --max-model-len 4096 --output $W/one/host_overhead.json > $W/one/host.log 2>&1; P "host rc=$?" ) &
wait
pkill -f "pagedserve.entrypoints.cli" ; sleep 1
rm -rf $W/ttft/model; tar czf $OUT/one.tgz -C $W ttft one
P "tp start"
( while sleep 15; do cp $W/tp/progress.log $OUT/tp_progress.log 2>/dev/null; done ) &
PAGEDSERVE_TP_DEBUG=1 timeout ${TPLIMIT:-330} python3 benchmarks/tp_bench.py --out $W/tp/tp.json --progress-dir $W/tp --child-timeout ${CHILD:-110} --num-requests 500 > $W/tp/bench.log 2>&1
P "tp_bench rc=$?"
timeout 85 python3 benchmarks/tp_serve_check.py --timeout 75 --out $W/tp/tp_serve.json > $W/tp/tp_serve.log 2>&1; P "serve check rc=$?"
cp $W/tp/tp.json $W/tp/tp_serve.json $OUT/ 2>/dev/null; tar czf $OUT/tp.tgz -C $W tp
cut -c1-220 $W/tp/progress.log | grep -v "^pagedserve tp" | tail -20; tail -3 $W/tp/tp_serve.log; grep -h "rate\|up after" $W/ttft/progress.log | cut -c1-300
