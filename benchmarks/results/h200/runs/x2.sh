#!/usr/bin/env bash
# The device tool's wrapper around benchmarks/h200x2_run.sh that the runs here name as .gpu/x2.sh
# (kept once; .gpu/common.sh installs the server's wheels into a site dir on PYTHONPATH, sets the NCCL
# switches h200x2_run.sh also sets, and defines P, which logs a line to $OUT/progress.log).
# one target of benchmarks/h200x2_run.sh, with the wheels installed; progress mirrored to $OUT
source .gpu/common.sh
( while sleep 15; do cp logs/x2/progress.log $OUT/ 2>/dev/null; done ) &
P "start $1 $(nvidia-smi -L | wc -l) GPUs"
timeout ${2:-560} bash benchmarks/h200x2_run.sh $1
P "end $1 rc=$?"
tar czf $OUT/x2_$1_all.tgz -C logs/x2 .
grep -h "TP=2 / TP=1\|ratio\|frames\|drop\|rc=\|Error\|kernel ms\|step ms" logs/x2/*.log logs/x2/progress.log 2>/dev/null | cut -c1-250 | tail -30
