#!/usr/bin/env bash
# Call 9 (one H200, same machine): offline side by side (nanovllm, fixed256).
set -u
T=$(dirname "$(mktemp -u)")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

W=$T/vsw; mkdir -p $W
( while sleep 15; do cp $W/progress.log $OUT/ 2>/dev/null; done ) &
LOOP=$!; trap "kill $LOOP 2>/dev/null" EXIT
timeout ${LIMIT:-560} python3 benchmarks/vs_vllm.py offline --site $T/site --gpus 0 --work $W --device "NVIDIA H200" \
  --offline-limit 200 > $W/offline.log 2>&1
echo "offline rc=$?"
cp $W/progress.log $OUT/; tar czf $OUT/all.tgz --exclude=model -C $W .
cut -c1-250 $W/progress.log
