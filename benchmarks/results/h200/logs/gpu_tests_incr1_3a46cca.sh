#!/usr/bin/env bash
# Call 1 (one H200): vLLM chunk c1; GPU tests with PAGEDSERVE_INCREMENTAL_INPUTS=1; host-overhead A/B of the incremental inputs.
set -u
T=$(dirname "$(mktemp -u)"); mkdir -p $T/vc && cp -r .vllm-carry/c7 $T/vc/
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/ps_site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:$T/ps_site
W=$(mktemp -d)
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
P start; python3 -c "import httpx" 2>/dev/null && P "httpx present"; python3 -c "import aiohttp" 2>/dev/null && P "aiohttp present"
PAGEDSERVE_INCREMENTAL_INPUTS=1 timeout ${TT:-330} python3 -m pytest -q -p no:cacheprovider tests/runner/test_incremental_inputs.py \
   tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py tests/engine/test_cuda_piecewise.py > $OUT/gpu_tests_incr1.log 2>&1
rc=$?; P "gpu tests (incremental=1) rc=$rc"; [ $rc = 0 ] && touch $T/incr_ok
tail -5 $OUT/gpu_tests_incr1.log
for m in 0 1; do
  PAGEDSERVE_INCREMENTAL_INPUTS=$m timeout 100 python3 benchmarks/host_overhead.py --model benchmarks/models/qwen3-0.6b --max-model-len 4096 \
     --output $OUT/host_overhead_incr$m.json > $W/host$m.log 2>&1; P "host incr=$m rc=$?"; tail -4 $W/host$m.log | cut -c1-300
done
cp $W/*.log $OUT/ 2>/dev/null; P done
