#!/usr/bin/env bash
# offline step profiles (nanovllm, fixed256) and a nanovllm-like decode-step kernel profile
source .gpu/common.sh
R=$OUT/p1; mkdir -p $R
P "start p1"
timeout 150 python3 benchmarks/offline_steps.py --workload nanovllm --keep-trace $R/steps_nanovllm.jsonl --output $R/offline_steps_nanovllm.json > $R/nanovllm.log 2>&1; P "nanovllm rc=$?"
timeout 100 python3 benchmarks/profile_decode.py --cuda-graphs --num-seqs 256 --prompt-len 100,1024 --temperature 0.6 --steps 20 --output $R/profile_decode_qwen_n256_nanovllm.json --trace-dir $R/trace256 > $R/profile256.log 2>&1; P "profile256 rc=$?"
timeout 180 python3 benchmarks/offline_steps.py --workload fixed256 --keep-trace $R/steps_fixed256.jsonl --output $R/offline_steps_fixed256.json > $R/fixed256.log 2>&1; P "fixed256 rc=$?"
tar czf $OUT/p1.tgz -C $OUT p1
python3 - <<'PY'
import json,os
for w in ("nanovllm","fixed256"):
    p=os.environ["OUT"]+f"/p1/offline_steps_{w}.json"
    if not os.path.exists(p): print(w,"missing"); continue
    r=json.load(open(p))["results"]
    print(w,{k:r[k] for k in ("traced_run_s","busy_s","gap_s","ideal_s","ideal_over_busy","outside_steps_s")})
    for k,g in r["groups"].items(): print(" ",k,g["steps"],g["busy_ms_per_step"],g["ideal_over_busy"],g["share_of_busy"])
PY
grep -A30 "top kernels\|kernel ms" $R/profile256.log | head -40
