#!/usr/bin/env bash
# Call 8 (one H200): last vLLM chunk + install, then online side by side (vLLM, then pagedserve), rates 10 20 40.
set -u
T=$(dirname "$(mktemp -u)"); mkdir -p $T/vc && cp -r .vllm-carry/c8 $T/vc/
bash $T/vc/c1/install_vllm.sh $T/vc > $OUT/install.log 2>&1; echo "install rc=$?"; tail -2 $OUT/install.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

W=$T/vsw; mkdir -p $W
( while sleep 15; do cp $W/progress.log $OUT/ 2>/dev/null; done ) &
timeout ${LIMIT:-520} python3 benchmarks/vs_vllm.py online --site $T/site --gpus 0 --work $W --device "NVIDIA H200" \
  --startup-limit 200 --rate-limit 100 > $W/online.log 2>&1
echo "online rc=$?"
cp $W/progress.log $OUT/; tar czf $OUT/online.tgz --exclude=model -C $W .
cut -c1-250 $W/progress.log
