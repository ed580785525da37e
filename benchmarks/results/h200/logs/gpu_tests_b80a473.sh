#!/usr/bin/env bash
# Last vLLM chunk + install, then the GPU tests of the new code (both GPUs in parallel).
set -u
T=$(dirname "$(mktemp -u)")
mkdir -p $T/vc && cp -r .vllm-carry/c8 $T/vc/ && bash $T/vc/c1/install_vllm.sh $T/vc > $OUT/install.log 2>&1; echo "install rc=$?"; tail -2 $OUT/install.log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$T/site
( CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m pytest -q -p no:cacheprovider ${TESTS0:-tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py} > $OUT/gpu0.log 2>&1; echo "gpu0 rc=$?" >> $OUT/gpu0.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout 260 python3 -m pytest -q -p no:cacheprovider ${TESTS1:-tests/layers/test_fused_gpu.py tests/attention/test_triton_gpu.py} > $OUT/gpu1.log 2>&1; echo "gpu1 rc=$?" >> $OUT/gpu1.log ) &
wait
tail -15 $OUT/gpu0.log $OUT/gpu1.log
