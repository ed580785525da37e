#!/usr/bin/env bash
# The MoE GPU work (issue #33), one section per call (each fits a 10-minute device call):
#   bash benchmarks/moe_run.sh tests|layer|steps
#   bash benchmarks/moe_run.sh tune_qwen|tune_mixtral [bfloat16|fp8_w8a8|all]   (default bfloat16; ~4 min each)
#   bash benchmarks/moe_run.sh fp8                       (FP8 MoE GPU tests, then the layer FP8 vs bf16, batch 1..256)
#   bash benchmarks/moe_run.sh offline MODEL WORKLOAD   (qwen3-30b-a3b|mixtral-8x7b, nanovllm|fixed256)
#   bash benchmarks/moe_run.sh ep_layer                  (one GPU: a rank's share at TP=2, sharded vs whole experts)
#   bash benchmarks/moe_run.sh ep MODEL [WORKLOAD...]    (two GPUs: TP=2 sharded vs expert parallel, parts for moe_collect.py)
# Results and logs go under ${OUT:-benchmarks/results/h200}; tuned tables are written into
# $OUT/configs.tgz (unpack it into pagedserve/layers/fused_moe/configs/ and commit) and copied into
# that directory of the device's tree, so later sections of the same session use them.
# Like h200_run.sh: a tree without .git needs pagedserve/_build_commit.json for result files.
#
# Issue #33's missing H200 figures, one lease per device call (`bash benchmarks/moe_run.sh quick`
# prints the sequence, the time of each call and which calls must share a lease):
#   bash benchmarks/moe_run.sh tune_layer               (graph-timed retune of both bf16 tables, then the
#                                                        layer vs vLLM's fused_experts; vLLM in $SITE)
#   bash benchmarks/moe_run.sh tune_wide [MODEL|both]   (the wider search at the counts where the layer trails
#                                                        vLLM's, then the layer again; vLLM in $SITE)
#   bash benchmarks/moe_run.sh pair MODEL [both|vllm|ours] [WORKLOAD...]   (offline, default nanovllm + fixed256, vLLM then ours)
#   bash benchmarks/moe_run.sh online MODEL [both|vllm|ours] (sharegpt-like at 30/60/90% of vLLM's saturation)
# $SITE: the folder vLLM 0.26 is installed in (install it in the same call, first). Each call writes
# $O/lease.txt ("<lease id> new|continued ..."): a call that finds the id of an earlier call left
# in /tmp ran on the same machine, still held. Collect on the CPU with benchmarks/offline/moe_collect.py.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keep a vLLM site (layer --vllm)
if [ "${1:-}" = quick ]; then sed -n '/^# QUICK/,/^# END QUICK/p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
O=${OUT:-benchmarks/results/h200}
mkdir -p "$O/logs"
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> "$O/logs/progress.log"
  timeout "$limit" "$@" > "$O/logs/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$?" >> "$O/logs/progress.log"
}
lease() {  # this call's lease into $O/lease.txt; the id stays in /tmp while the machine is held
  local f=/tmp/pagedserve_moe_lease state=continued
  [ -s $f ] || { echo "$(date -u +%Y%m%dT%H%M%SZ)-$RANDOM" > $f; state=new; }
  echo "$(cat $f) $state $(date -u +%FT%TZ) $*" >> "$O/lease.txt"
}
need_site() {
  [ -n "${SITE:-}" ] && [ -d "$SITE/vllm" ] || { echo "set SITE to the folder vLLM 0.26 is installed in" >&2; exit 2; }
}
case "${1:-}" in
  tune_layer)  # ~5 min; limits 140 + 140 + 200 s (+ vLLM's install: under 9 min)
    lease tune_layer
    mkdir -p "$O/configs"
    # Start from the committed tables: a token count the time limit leaves out keeps its old entry
    # (without "timing": do_bench-tuned) instead of vanishing.
    cp pagedserve/layers/fused_moe/configs/E=*.json "$O/configs/"
    for m in qwen3-30b-a3b mixtral-8x7b; do
      step "tune_${m//-/_}_bfloat16" 140 python3 benchmarks/kernels/tune_fused_moe.py --model "$m" --dtype bfloat16 \
        --max-seconds 100 --output-dir "$O/configs"
    done
    cp "$O"/configs/E=*.json pagedserve/layers/fused_moe/configs/
    # The device tool does not bring back files whose names hold '=' or ',' (every table's): a tarball does.
    tar czf "$O/configs.tgz" -C "$O/configs" . && rm -rf "$O/configs"
    step moe_layer 200 env PYTHONPATH="$PWD${SITE:+:$SITE}" python3 benchmarks/kernels/bench_fused_moe.py \
      ${SITE:+--vllm} --output "$O/moe_layer.json" ;;
  tune_wide)  # [MODEL|both] ~6 min for both: tune_layer's retune with search_space(wide) at the token counts
              # where the layer trailed vLLM's (moe_layer.json at ba18304), then the layer again (vLLM in $SITE)
    which=${2:-both}; lease "tune_wide $which"
    mkdir -p "$O/configs"
    cp pagedserve/layers/fused_moe/configs/E=*.json "$O/configs/"
    if [ "$which" != qwen3-30b-a3b ]; then
      step tune_mixtral_8x7b_wide 150 python3 benchmarks/kernels/tune_fused_moe.py --model mixtral-8x7b --wide \
        --tokens 1 64 128 256 512 --max-seconds 120 --output-dir "$O/configs"
    fi
    if [ "$which" != mixtral-8x7b ]; then
      step tune_qwen3_30b_a3b_wide 120 python3 benchmarks/kernels/tune_fused_moe.py --model qwen3-30b-a3b --wide \
        --tokens 1 2 4 256 512 --max-seconds 90 --output-dir "$O/configs"
    fi
    cp "$O"/configs/E=*.json pagedserve/layers/fused_moe/configs/
    tar czf "$O/configs.tgz" -C "$O/configs" . && rm -rf "$O/configs"
    models=$([ "$which" = both ] && echo "qwen3-30b-a3b mixtral-8x7b" || echo "$which")
    step moe_layer 200 env PYTHONPATH="$PWD${SITE:+:$SITE}" python3 benchmarks/kernels/bench_fused_moe.py \
      ${SITE:+--vllm} --models $models --output "$O/moe_layer.json" ;;
  pair)  # MODEL [both|vllm|ours] [WORKLOAD...] (default nanovllm fixed256): vLLM's offline runs (one LLM,
         # the workloads), then ours (one engine)
    m=${2:?model}; which=${3:-both}; shift $(( $# < 3 ? $# : 3 )); wls=${*:-nanovllm fixed256}
    lease "pair $m $which $wls"
    big=$([ "$m" = mixtral-8x7b ] && echo 1 || echo 0)
    if [ "$which" != ours ]; then
      need_site
      set -- $wls; first=$1; shift; also=${*:+--also $*}
      step "vllm_offline_$m" $([ $big = 1 ] && echo 330 || echo 230) env PYTHONPATH="$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 \
        OUT="$O" python3 benchmarks/serving/peers/bench_vllm.py --workload "$first" $also \
        --config "benchmarks/models/$m/config.json" --tag "$m"
    fi
    if [ "$which" != vllm ]; then
      step "moe_offline_$m" $([ $big = 1 ] && echo 300 || echo 230) python3 benchmarks/offline/moe_offline.py --one-engine \
        --models "$m" --workloads $wls --repeats 1 --output "$O/moe_offline_$m.json"
    fi ;;
  online)  # MODEL [both|vllm|ours]; N requests a rate (200 Qwen, 120 Mixtral); RATES for ours alone; GPUS=0,1 for both at once
    m=${2:?model}; which=${3:-both}; lease "online $m $which"; need_site
    n=${N:-$([ "$m" = mixtral-8x7b ] && echo 120 || echo 200)}
    # MOE_WORK (on the device: a /tmp folder) keeps the runs' ~20 files out of $OUT, of which the
    # device tool brings back 8 (the 25th session lost vLLM's results so): a tarball of them lands in $O.
    base=${MOE_WORK:-$O}; work="$base/online_$m"; mkdir -p "$work"
    saved=/tmp/pagedserve_moe_rates_$m.json
    case "$which" in
      ours) rates=${RATES:-$(python3 -c "import json; print(*json.load(open('$saved'))['rates'])" 2>/dev/null)}
            [ -n "$rates" ] || { echo "ours alone: set RATES to the vllm call's online_$m/rates.json rates" >&2; exit 2; }
            [ -f "$saved" ] && [ -z "${RATES:-}" ] && cp "$saved" "$work/rates.json"
            args="--engines pagedserve --rates $rates" ;;
      vllm) args="--engines vllm --saturation-fractions 0.3 0.6 0.9" ;;
      both) args="--saturation-fractions 0.3 0.6 0.9 --gpus ${GPUS:-0}" ;;
      *) echo "online MODEL both|vllm|ours" >&2; exit 2 ;;
    esac
    step "online_${m}_$which" 500 python3 benchmarks/serving/vs_vllm.py online --site "$SITE" --work "$work" \
      --model "benchmarks/models/$m" --num-requests "$n" --max-arrival-seconds "${ARRIVAL_S:-45}" --salt-rates $args
    [ -f "$work/rates.json" ] && cp "$work/rates.json" "$saved"
    cp "$work/progress.log" "$O/logs/online_${m}_progress.log" 2>/dev/null
    [ "$base" = "$O" ] || tar czf "$O/online_$m.tgz" -C "$base" --exclude="online_$m/model" "online_$m" ;;
  tests) step moe_kernel_tests 250 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fused_moe_gpu.py
         step moe_model_tests 310 python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda_runner.py \
           tests/engine/test_cuda_engine.py tests/runner/test_warmup_gpu.py -k "moe or mixtral" ;;
  tune_qwen|tune_mixtral)
    model=$([ "$1" = tune_qwen ] && echo qwen3-30b-a3b || echo mixtral-8x7b)
    dtypes=${2:-bfloat16}; [ "$dtypes" = all ] && dtypes="bfloat16 fp8_w8a8"
    mkdir -p "$O/configs"
    for dt in $dtypes; do  # each: --max-seconds 200 stops starting token counts; 270 s hard limit
      step "tune_${model//-/_}_$dt" 270 python3 benchmarks/kernels/tune_fused_moe.py --model "$model" --dtype "$dt" \
        --max-seconds 200 --output-dir "$O/configs"
    done
    cp "$O"/configs/E=*.json pagedserve/layers/fused_moe/configs/ 2>/dev/null
    tar czf "$O/configs.tgz" -C "$O/configs" . && rm -rf "$O/configs" ;;
  fp8) step moe_fp8_tests 300 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fused_moe_fp8_gpu.py
       step moe_fp8_layer 250 python3 benchmarks/kernels/bench_fused_moe.py --models qwen3-30b-a3b --fp8 \
         --batches 1 2 4 8 16 32 64 128 256 --output "$O/moe_fp8_layer.json" ;;
  layer) step moe_layer 560 python3 benchmarks/kernels/bench_fused_moe.py ${VLLM:+--vllm} --output "$O/moe_layer.json" ;;
  offline) step "moe_offline_$2_$3" 580 python3 benchmarks/offline/moe_offline.py --models "$2" --workloads "$3" --merge \
             ${VLLM_DIR:+--vllm-dir $VLLM_DIR} --output "$O/moe.json" ;;
  steps) step moe_offline_steps 560 python3 benchmarks/offline/offline_steps.py --workload nanovllm \
           --model benchmarks/models/qwen3-30b-a3b --output "$O/offline_steps_qwen3_30b_a3b.json" ;;
  ep_layer) lease ep_layer  # ~3 min (200 + 200 s caps)
            step moe_layer_tp2 200 python3 benchmarks/kernels/bench_fused_moe.py --tp 2 --output "$O/moe_layer_tp2.json"
            step moe_layer_tp2_ep 200 python3 benchmarks/kernels/bench_fused_moe.py --tp 2 --expert-parallel \
              --output "$O/moe_layer_tp2_ep.json" ;;
  ep)  # MODEL [WORKLOAD...] (default both): TP=2 sharded, then expert parallel, each one engine for the workloads;
       # parts moe_offline_<model>_tp2[_ep].json for moe_collect.py (results <model>_<workload>_tp2[_ep])
    m=${2:?model}; shift 2; wls=${*:-nanovllm fixed256}; lease "ep $m $wls"
    cap=$([ "$m" = mixtral-8x7b ] && echo 270 || echo 230)
    step "moe_offline_${m}_tp2" $cap python3 benchmarks/offline/moe_offline.py --one-engine --models "$m" \
      --workloads $wls --repeats 1 --tag tp2 --engine-args "--tensor-parallel-size 2" --output "$O/moe_offline_${m}_tp2.json"
    step "moe_offline_${m}_tp2_ep" $cap python3 benchmarks/offline/moe_offline.py --one-engine --models "$m" \
      --workloads $wls --repeats 1 --tag tp2_ep --engine-args "--tensor-parallel-size 2 --enable-expert-parallel" \
      --output "$O/moe_offline_${m}_tp2_ep.json" ;;
  *) echo "usage: $0 quick|tune_layer|pair MODEL [WHICH]|online MODEL [WHICH]|tests|tune_qwen [DTYPE]|tune_mixtral [DTYPE]|fp8|layer|steps, or offline MODEL WORKLOAD" >&2; exit 2 ;;
esac
tail -3 "$O/logs/progress.log"

# QUICK: issue #33's missing H200 figures (2026-12-02 plan; figures it builds on: the MoE tuner took
# 61-77 s per model and dtype with do_bench, vLLM 0.26's LLM() took 96 s for Qwen3-30B-A3B and its
# runs 25 s (nanovllm) and 28 s (fixed256), ours 23 s and 14 s; our engine starts Llama-3.1-8B in
# 45-50 s (the MoE models: ~70 s and ~100 s assumed), vLLM in 60-110 s (Mixtral: ~150 s assumed);
# a fresh machine ~1 min; vLLM's install ~30 s; the machine goes back 30 s after a call ends).
# Every call: OUT=$OUT, `timeout 570` around it, progress in $OUT/logs/progress.log as it goes;
# online calls also MOE_WORK=/tmp/moe_work (the device brings back 8 files of $OUT: online_MODEL.tgz).
# "vLLM" = install vLLM 0.26 into $SITE first, in the same call.
#
# Lease 1 (~15 device minutes):
#  1. tune_layer (vLLM)  ~5 min: install 30 s; retune Qwen3-30B-A3B bf16 ~80 s and Mixtral-8x7B bf16
#     ~75 s (graph-timed, from the committed tables, --max-seconds 100, 140 s caps); the layer at batch
#     1..512 for both models, ours vs vLLM's fused_experts, graph-timed ~120 s (200 s cap).
#     Then, on the CPU: unpack $OUT/configs.tgz (the tables, E=*.json) into pagedserve/layers/fused_moe/configs/ (every
#     later call must run with them) and commit them.
#  2. pair qwen3-30b-a3b (vLLM)  ~6 min: install 30 s; vLLM nanovllm + fixed256 on one LLM, one run
#     each ~165 s (230 s cap); ours, one engine, both workloads, the cold run each plus a traced
#     nanovllm run (decode-step roofline) ~160 s (230 s cap). Both engines in this one call.
# Lease 2, or lease 1 if 12+ minutes remain (~10 min):
#  3. pair mixtral-8x7b vllm (vLLM)  ~5 min: install 30 s, LLM() ~150 s, nanovllm ~45 s, fixed256 ~55 s (330 s cap).
#  4. pair mixtral-8x7b ours  ~4.5 min: start ~100 s, nanovllm cold + traced ~100 s, fixed256 ~35 s
#     (300 s cap). MUST share call 3's lease: issue it at once after 3 (lease.txt must say
#     "continued"; otherwise collect flags vllm_same_lease false: run 3 and 4 again). Together (~9.3
#     min) they do not fit one call's 9 minutes.
# Lease 3 (~25 min; sharegpt-like, --salt-rates, rates at 30/60/90% of vLLM's saturation from a probe
# with every request at once, vs_vllm.saturation_req_s):
#  5. [measured 2026-12-02, s25_online_qwen3] online qwen3-30b-a3b vllm (vLLM)  ~5.5 min: install 30 s, server ~100 s, probe ~45 s, 3 rates of
#     200 requests (~80 s of arrivals at a saturation of ~15 req/s, ~25 s drain each).
#  6. [measured, s25] online qwen3-30b-a3b ours (vLLM: its server wheels)  ~4 min: server ~70 s, the same 3 rates. MUST
#     share call 5's lease (at once after it; the rates come from /tmp, or RATES="..." from 5's rates.json).
#  7. [measured 2026-12-02, s26_2_online_mixtral: 6.2 min] online mixtral-8x7b vllm (vLLM)  ~7.5 min: server ~150 s, probe ~50 s, 3 rates of up to 120
#     requests (~90 s of arrivals at ~7 req/s, ~40 s drain each: 20 ms a token x the longest output).
#     Every rate sends at most rate x 45 s of requests (ARRIVAL_S; at least 60), so a slower vLLM
#     (a probe under 5 req/s) still fits the step's 500 s.
#  8. [measured, s26: 4.8 min] online mixtral-8x7b ours (vLLM)  ~5.5 min. MUST share call 7's lease.
#  On a 2-GPU machine (kind nvidia-h200-x2), `GPUS=0,1 ... online MODEL both` runs 5+6 (~6 min) and
#  7+8 (~8 min) as one call each, one engine per GPU, ours waiting for vLLM's rates.
# Lease 4 (kind nvidia-h200-x2, ~15 min): expert parallelism against sharding (#33 asks for it, as EP
# was built; nothing measured yet), ours only, so any lease:
#  9. [measured, s26_1_ep_layer: 1.2 min] ep_layer  ~3 min: a rank's share of the layer at TP=2, sharded vs whole experts (one GPU).
# 10. ep qwen3-30b-a3b  ~5 min: TP=2 sharded then EP, each one engine (~70 s start, ~60 s of runs).
# 11. ep mixtral-8x7b  ~7 min (~100 s starts).
# Collect (CPU): copy each call's $OUT into benchmarks/results/h200/moe_parts/<n>_<section>/ (n orders
# them: the newest layer part wins), then
#   python benchmarks/offline/moe_collect.py --parts benchmarks/results/h200/moe_parts --output benchmarks/results/h200/moe.json
# (it also copies the newest moe_layer.json part over benchmarks/results/h200/moe_layer.json).
# END QUICK
