#!/usr/bin/env bash
# The 2xH200 figures still owed (issues #14, #15, #17), one device call (<= 10 min) per target.
# Run from the repo root on the GPU machine, in this order:
#   bash benchmarks/h200x2_run.sh tp_allreduce   # Llama-3.1-8B fixed256 at TP=1 and 2: NCCL, then
#                                                # PAGEDSERVE_TP_ALLREDUCE=symm_mem (and its agreement
#                                                # with TP=1), then NCCL_PROTO=LL128,Simple
#   bash benchmarks/h200x2_run.sh tp_opt         # OPT-13B fixed256 at TP=1 and 2 (1000 requests need > 105 s a child)
#   bash benchmarks/h200x2_run.sh dp             # DP=2 (4 front-end processes) against DP=1, 7000 sharegpt-like requests at t=0,
#                                                # 8 client processes; the rate at saturation from the servers' counters
#   bash benchmarks/h200x2_run.sh dp_long        # the same, 12000 requests (at most 4096 in flight)
#   bash benchmarks/h200x2_run.sh dashboard_toggle  # the dashboard's cost within one long run, the viewer toggled every 3 s
#   bash benchmarks/h200x2_run.sh dashboard_toggle_engine_bound  # the same with the engine the bottleneck: Llama-3.1-8B
#                                                # (dummy weights) at 64 sequences a step, not the demo model behind one
#                                                # API server at 4096 streams (whose segments vary by +-20%)
#   bash benchmarks/h200x2_run.sh launch_ab      # #13: our server alone at rates 10 20 40, the decode launch of 925e530
#                                                # against the one before (PAGEDSERVE_DECODE_LAUNCH=rows+nolpt+bn64), each
#                                                # with a step trace: is the mixed steps' tail of 925e530's lease the launch's
#                                                # or that lease's host? (needs the server's wheels in ${SITE:-/tmp/ps_site})
#   bash benchmarks/h200x2_run.sh short_prefill_ab  # #13: the same with short prefills on the decode graphs
#                                                # (runner/decode_rows.py, the default since 5574bce) and
#                                                # off (PAGEDSERVE_SHORT_PREFILL_GRAPHS=0), on one machine
#   bash benchmarks/h200x2_run.sh dashboard      # the dashboard's cost and frame rate on GPU 0 (0.4 s default), then
#                                                # Llama-3.1-8B decode-step profiles at 16 and 32 sequences (#13's TPOT)
#   bash benchmarks/h200x2_run.sh profiles       # Llama-3.1-8B decode steps as serving runs them (CUDA graphs) at 16,
#                                                # 32 and 256 sequences on GPU 0 (#13: kernel time against the step
#                                                # period); then TP=2 eager steps at 256 on NCCL and on symm_mem (#14)
# A copy of the tree without .git must carry pagedserve/_build_commit.json (see h200_run.sh). Results
# go to logs/x2/<target>/ (copy the ones to keep into benchmarks/results/h200x2/ or h200/), and with
# $OUT set into $OUT/x2_<target>.tgz; logs/x2/progress.log says when each step started and ended.
# NVLink multicast stays off.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=logs/x2
mkdir -p $L
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $L/NAME.log
  local name=$1 limit=$2; shift 2
  mkdir -p "$L/$name"
  echo "$(date +%T) start $name" >> $L/progress.log
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$?" >> $L/progress.log
}
tp() {  # tp NAME SECONDS ARGS...: tp_bench into $L/NAME/
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 benchmarks/distributed/tp_bench.py --skip-agreement --out "$L/$name/tp.json" \
    --progress-dir "$L/$name" "$@"
}
ours_alone() {  # ours_alone NAME VAR=VALUE...: our server alone at 10/20/40 req/s with a step trace, in $L/NAME/
  local name=$1 W=$L/$1; shift
  step "$name" 280 env "$@" PAGEDSERVE_STEP_TRACE=$W/step_trace.jsonl python3 benchmarks/serving/vs_vllm.py online \
    --engines pagedserve --site "${SITE:-/tmp/ps_site}" --gpus 0 --work $W --device "NVIDIA H200" \
    --startup-limit 150 --rate-limit 90
  python3 benchmarks/serving/step_trace_summary.py $W/step_trace.jsonl --split-s 5 --out $W/step_trace_summary.json > /dev/null
  gzip -f $W/step_trace.jsonl
}
case "${1:-}" in
  tp_allreduce)
    tp tp_nccl 200 --models llama-3.1-8b --child-timeout 90
    PAGEDSERVE_TP_ALLREDUCE=symm_mem tp tp_symm_mem 110 --models llama-3.1-8b --tp-sizes 2 --child-timeout 100
    # The same tokens as TP=1 (or within its top 5) with the symmetric-memory all-reduce.
    PAGEDSERVE_TP_ALLREDUCE=symm_mem step tp_symm_mem_agreement 150 python3 benchmarks/distributed/tp_bench.py --skip-throughput \
      --out $L/tp_symm_mem_agreement/tp.json --progress-dir $L/tp_symm_mem_agreement --child-timeout 55
    NCCL_PROTO=LL128,Simple tp tp_nccl_ll128 110 --models llama-3.1-8b --tp-sizes 2 --child-timeout 100 ;;
  tp_opt) tp tp_opt 500 --models opt-13b --child-timeout 240 ;;
  dp) step dp 580 python3 benchmarks/distributed/dp_bench.py --out $L/dp/dp.json --num-requests 7000 --start-timeout 200 --api-server-counts 4 \
        --run-timeout 240 --num-client-processes 8 ;;
  dp_long)  # the same with 12000 requests, at most 4096 in flight: the drain at the end (the last long
            # requests at a small batch, as long in both runs) weighs less against the saturated part
    step dp_long 585 python3 benchmarks/distributed/dp_bench.py --out $L/dp_long/dp.json --num-requests 12000 --max-concurrency 4096 \
        --start-timeout 150 --api-server-counts 4 --run-timeout 330 --num-client-processes 8 ;;
  dashboard_toggle)  # one long run, the viewer opened and closed every 3 s; the drop from the engine's counter.
    # 4096 in flight; 60000 requests keep the server saturated ~2 min (8000 took 18 s at 6d9dcd9).
    # The server's log is kept beside the results (the 6d9dcd9 run lost 2024 requests, its log lost).
    CUDA_VISIBLE_DEVICES=0 step dashboard_toggle 400 python3 benchmarks/dashboard/dashboard_overhead.py --device cuda --toggle 3 \
      --num-requests 60000 --client-processes 4 --max-concurrency 4096 --serve-args "--num-gpu-blocks-override 65536" \
      --server-log $L/dashboard_toggle/server.log --output $L/dashboard_toggle/dashboard_overhead_toggle.json ;;
  dashboard_toggle_engine_bound)
    # The demo model's run is bound by the API server's streaming (segment rates 7-23k tok/s at
    # 5dc9c77), too noisy to resolve a 2% drop. Here the GPU sets the pace: 64 sequences a step of
    # an 8B model (~5.4 ms) is ~12k tok/s. At a1330ea two client processes (~3.3k tok/s each)
    # kept the batch at 45 sequences (median): eight here, 1024 in flight. The engine's own decode
    # rate per segment comes from its step trace (dashboard_overhead.engine_segment_rates).
    W=$L/dashboard_toggle_engine_bound
    mkdir -p $W
    python3 benchmarks/serving/peers/make_bench_model_dir.py benchmarks/models/llama-3.1-8b $W/model > /dev/null
    CUDA_VISIBLE_DEVICES=0 PAGEDSERVE_STEP_TRACE=$W/step_trace.jsonl step dashboard_toggle_engine_bound 450 \
      python3 benchmarks/dashboard/dashboard_overhead.py --device cuda --toggle 3 --model $W/model --num-requests 30000 \
      --client-processes 8 --max-concurrency 1024 --serve-args "--load-format dummy --max-model-len 2048 --max-num-seqs 64" \
      --server-log $W/server.log --output $W/dashboard_overhead_toggle.json
    python3 benchmarks/serving/step_trace_summary.py $W/step_trace.jsonl --split-s 5 --out $W/step_trace_summary.json > /dev/null
    gzip -f $W/step_trace.jsonl ;;
  launch_ab)
    for v in base rows+nolpt+bn64; do ours_alone launch_ab_$v PAGEDSERVE_DECODE_LAUNCH=$v; done ;;
  short_prefill_ab)
    for v in 1 0; do ours_alone short_prefill_ab_$v PAGEDSERVE_SHORT_PREFILL_GRAPHS=$v; done ;;
  dashboard)
    CUDA_VISIBLE_DEVICES=0 step dashboard 270 python3 benchmarks/dashboard/dashboard_overhead.py --device cuda --rounds 3 \
      --num-requests 3000 --serve-args "--num-gpu-blocks-override 65536" --output $L/dashboard/dashboard_overhead.json
    for n in 16 32; do
      CUDA_VISIBLE_DEVICES=0 step profile_decode_n$n 100 python3 benchmarks/kernels/profile_decode.py \
        --model benchmarks/models/llama-3.1-8b --num-seqs $n --output $L/profile_decode_n$n/profile_decode_llama_n$n.json
    done ;;
  profiles)
    for n in 16 32 256; do
      CUDA_VISIBLE_DEVICES=0 step graphs_n$n 100 python3 benchmarks/kernels/profile_decode.py --cuda-graphs \
        --model benchmarks/models/llama-3.1-8b --num-seqs $n --output $L/graphs_n$n/profile_decode_graphs_n$n.json \
        --trace-dir $L/graphs_n$n/trace
    done
    step tp2_nccl 130 python3 benchmarks/kernels/profile_decode.py --model benchmarks/models/llama-3.1-8b \
      --tensor-parallel-size 2 --output $L/tp2_nccl/profile_decode_tp2.json
    PAGEDSERVE_TP_ALLREDUCE=symm_mem step tp2_symm_mem 130 python3 benchmarks/kernels/profile_decode.py \
      --model benchmarks/models/llama-3.1-8b --tensor-parallel-size 2 \
      --output $L/tp2_symm_mem/profile_decode_tp2_symm_mem.json ;;
  *) echo "usage: bash benchmarks/h200x2_run.sh tp_allreduce|tp_opt|dp|dp_long|dashboard|dashboard_toggle|dashboard_toggle_engine_bound|launch_ab|short_prefill_ab|profiles" >&2; exit 2 ;;
esac
# On the device tool's machine only $OUT comes back: everything of this target in one archive.
[ -n "${OUT:-}" ] && tar czf "$OUT/x2_$1.tgz" -C $L . && cp $L/progress.log "$OUT/"
exit 0
