#!/usr/bin/env bash
# Last call (2xH200 or one H200): the dashboard's cost and frame rate after the feed fix (GPU 0) beside
# fixed256 with the device's batch defaults (GPU 1; after the dashboard on one GPU).
set -u
T=$(dirname "$(mktemp -u)")
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/ps_site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:$T/ps_site
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
N=$(nvidia-smi -L | wc -l); P "start, $N GPU(s)"
dash() { CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/dashboard_overhead.py --device cuda --rounds 3 --num-requests 3000 \
   --serve-args "--num-gpu-blocks-override 65536" --output $OUT/dashboard_overhead.json > $OUT/dashboard.log 2>&1; P "dashboard rc=$?"; }
f256() { CUDA_VISIBLE_DEVICES=$1 timeout 150 python3 -m pagedserve.entrypoints.cli bench throughput --workload fixed256 \
   --output $OUT/fixed256_defaults.json > $OUT/fixed256.log 2>&1; P "fixed256 rc=$?"; }
if [ "$N" -ge 2 ]; then dash & f256 1 & wait; else dash; f256 0; fi
tail -3 $OUT/dashboard.log | cut -c1-300; grep -h "timed run\|max_num" $OUT/fixed256.log | tail -4
