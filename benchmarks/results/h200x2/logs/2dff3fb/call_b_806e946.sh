#!/usr/bin/env bash
# Call B (2xH200): TP=1 vs TP=2 (agreement, fixed256 on Llama-3.1-8B and OPT-13B), then `serve --tensor-parallel-size 2`.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:/tmp/site
W=$(mktemp -d)
( while sleep 15; do cp $W/progress.log $OUT/tp_progress.log 2>/dev/null; done ) &
( while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ')" >> $W/smi.log; done ) &
PAGEDSERVE_TP_DEBUG=1 timeout ${TPLIMIT:-440} python3 benchmarks/tp_bench.py --out $W/tp.json --progress-dir $W --child-timeout ${CHILD:-170} ${TPARGS:-}
echo "tp_bench rc=$?"
timeout 130 python3 benchmarks/tp_serve_check.py --timeout 110 --out $W/tp_serve.json > $W/tp_serve.log 2>&1; echo "serve check rc=$?"
cp $W/progress.log $OUT/tp_progress.log; cp $W/tp.json $W/tp.partial.json $W/tp_serve.json $OUT/ 2>/dev/null
tar czf $OUT/tpb.tgz -C $W . ; cut -c1-250 $OUT/tp_progress.log | tail -30; tail -5 $W/tp_serve.log
