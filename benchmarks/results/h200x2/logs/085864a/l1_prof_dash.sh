#!/usr/bin/env bash
# Lease 1, call 2: TP=2 and TP=1 decode-step profiles of Llama-3.1-8B (256 seqs), then the dashboard's cost on GPU 0.
source .gpu/common.sh
W=$(mktemp -d)
P "prof tp2"
timeout 200 python3 benchmarks/profile_decode.py --model benchmarks/models/llama-3.1-8b --tensor-parallel-size 2 \
  --output $W/profile_decode_tp2.json > $W/prof_tp2.log 2>&1; P "prof tp2 rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 130 python3 benchmarks/profile_decode.py --model benchmarks/models/llama-3.1-8b \
  --output $W/profile_decode_llama_tp1.json > $W/prof_tp1.log 2>&1; P "prof tp1 rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 benchmarks/dashboard_overhead.py --device cuda --rounds 3 --num-requests 3000 \
   --serve-args "--num-gpu-blocks-override 65536" --output $W/dashboard_overhead.json > $W/dashboard.log 2>&1; P "dashboard rc=$?"
tar czf $OUT/prof_dash.tgz -C $W .
grep -h "kernel ms" $W/prof_tp*.log; tail -4 $W/dashboard.log | cut -c1-300
