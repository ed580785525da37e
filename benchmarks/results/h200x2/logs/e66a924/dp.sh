#!/usr/bin/env bash
# 2xH200: DP=1 vs DP=2 at saturation, sharegpt-like, Llama-3.1-8B (issue #15).
set -u
T=$(dirname "$(mktemp -u)")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/ps_site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:$T/ps_site
W=$(mktemp -d)
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
P "dp start"; nvidia-smi -L | tee -a $OUT/progress.log
( while sleep 15; do cp $W/dp.log $OUT/ 2>/dev/null; done ) &
timeout ${DPL:-540} python3 benchmarks/dp_bench.py --out $W/dp.json --start-timeout 200 --run-timeout 200 --num-client-processes 4 > $W/dp.log 2>&1
P "dp rc=$?"
cp $W/dp.json $W/dp.md $W/dp.log $OUT/ 2>/dev/null; tar czf $OUT/dp.tgz -C $W .
tail -25 $W/dp.log | cut -c1-300
