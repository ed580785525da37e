#!/usr/bin/env bash
# c8 + vLLM install, then decode steps of both engines at 24 40 64 96 sequences (one engine each),
# and pagedserve's with the old decode graph sizes (every 16) for the A/B.
set -u
T=$(dirname "$(mktemp -u)"); mkdir -p $T/vc && cp -r .vllm-carry/c8 $T/vc/
bash $T/vc/c1/install_vllm.sh $T/vc > $OUT/install.log 2>&1; echo "install rc=$?"; tail -2 $OUT/install.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$T/vsd; mkdir -p $W/old
( while sleep 15; do cp $W/progress.log $OUT/ 2>/dev/null; done ) &
timeout 330 python3 benchmarks/vs_vllm.py decode --site $T/site --gpus 0 --work $W --device "NVIDIA H200" \
  --decode-seqs 24 40 64 96 --offline-limit 300 > $W/decode.log 2>&1
echo "decode rc=$?"
OLD=$(python3 -c 'import json; print(json.dumps({"cuda_graph_sizes": [1,2,4,8]+list(range(16,1025,16))}))')
PYTHONPATH=$PWD:$T/site timeout 150 python3 benchmarks/peers/decode_step_diff.py --engine pagedserve --num-seqs 24 40 64 96 \
  --pagedserve-kwargs "$OLD" --out $W/old/decode_pagedserve_n{n}.json > $W/old/decode.log 2>&1
echo "old sizes rc=$?"; tail -4 $W/old/decode.log
cp $W/progress.log $OUT/; tar czf $OUT/decode.tgz -C $W .
cut -c1-300 $W/progress.log
