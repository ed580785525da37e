#!/usr/bin/env bash
# Lease 1, call 1 (2xH200): TP bench with overlapped steps (agreement, llama + opt, TP 1 and 2), then llama TP=2 with them off.
source .gpu/common.sh
W=$(mktemp -d); mkdir -p $W/on $W/off
( while sleep 10; do cp $W/on/progress.log $OUT/on_progress.log 2>/dev/null; cp $W/off/progress.log $OUT/off_progress.log 2>/dev/null; done ) &
P "start $(nvidia-smi -L | wc -l) GPUs"
PAGEDSERVE_TP_DEBUG=1 timeout 380 python3 benchmarks/tp_bench.py --models llama-3.1-8b,opt-13b --async-scheduling on \
  --child-timeout 150 --out $W/on/tp.json --progress-dir $W/on > $W/on/bench.log 2>&1
P "tp on rc=$?"
PAGEDSERVE_TP_DEBUG=1 timeout 140 python3 benchmarks/tp_bench.py --skip-agreement --models llama-3.1-8b --tp-sizes 2 --async-scheduling off \
  --child-timeout 120 --out $W/off/tp.json --progress-dir $W/off > $W/off/bench.log 2>&1
P "tp off rc=$?"
cp $W/on/progress.log $OUT/on_progress.log; cp $W/off/progress.log $OUT/off_progress.log 2>/dev/null
tar czf $OUT/tp.tgz -C $W .
grep -h "TP=2 / TP=1\|done\|rc=\|Error\|error" $W/on/progress.log $W/off/progress.log | cut -c1-250 | tail -20
