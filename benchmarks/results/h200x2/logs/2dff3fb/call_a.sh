#!/usr/bin/env bash
# Call A (2xH200): TP=2 start-up diagnosis (agreement only, warm-up off), then DP=1 vs DP=2.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:/tmp/site
W=$(mktemp -d); mkdir -p $W/tp $W/dp
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
nvidia-smi -L >> $OUT/progress.log; python3 -c "import torch;print(torch.__version__, torch.cuda.device_count())" >> $OUT/progress.log 2>&1
( while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ')" >> $W/tp/smi.log; done ) & SMI=$!
P "tp diag start"
PAGEDSERVE_WARMUP=0 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT PAGEDSERVE_TP_DEBUG=1 timeout ${TPL:-200} python3 benchmarks/tp_bench.py --skip-throughput --models llama-3.1-8b --num-prompts 16 --max-tokens 16 --child-timeout ${CHILD:-150} --progress-dir $W/tp --out $W/tp/tp_diag.json > $W/tp/bench.log 2>&1
P "tp diag rc=$?"
kill $SMI; pkill -f tp_bench; sleep 2; nvidia-smi >> $W/tp/smi.log
tar czf $OUT/tp_diag.tgz -C $W tp
cut -c1-300 $W/tp/progress.log | tail -25
if [ "${DP:-1}" = 1 ]; then
P "dp start"
timeout ${DPL:-330} python3 benchmarks/dp_bench.py --out $W/dp/dp.json --start-timeout 200 --run-timeout 90 > $W/dp/dp.log 2>&1
P "dp rc=$?"
tar czf $OUT/dp.tgz -C $W dp; cp $W/dp/dp.json $OUT/ 2>/dev/null
tail -15 $W/dp/dp.log | cut -c1-300
fi
