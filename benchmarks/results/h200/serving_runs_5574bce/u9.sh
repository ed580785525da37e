#!/usr/bin/env bash
# Online side by side (vLLM, then pagedserve), rates 10 20 40, pagedserve's core tracing its steps.
set -u
T=$(dirname "$(mktemp -u)")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$T/vsw; mkdir -p $W
export PAGEDSERVE_STEP_TRACE=$W/step_trace.jsonl
( while sleep 15; do cp $W/progress.log $OUT/ 2>/dev/null; done ) &
LOOP=$!; trap "kill $LOOP 2>/dev/null" EXIT
timeout ${LIMIT:-540} python3 benchmarks/vs_vllm.py online --site $T/site --gpus 0 --work $W --device "NVIDIA H200" \
  --startup-limit 200 --rate-limit 100 > $W/online.log 2>&1
echo "online rc=$?"
python3 benchmarks/step_trace_summary.py $W/step_trace.jsonl --split-s 5 --out $W/step_trace_summary.json > /dev/null; echo "summary rc=$?"
gzip -k $W/step_trace.jsonl
cp $W/progress.log $OUT/; tar czf $OUT/online.tgz --exclude=model --exclude=step_trace.jsonl -C $W .
cut -c1-250 $W/progress.log
