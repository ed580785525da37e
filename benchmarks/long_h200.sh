#!/usr/bin/env bash
# Long contexts on the H200 (#35). Run from the repo root on the GPU machine; results and logs go
# under $OUT (progress in $OUT/progress.log), every step under its own `timeout`.
#   bash benchmarks/long_h200.sh quick        # ~9 min: GPU tests (unified kernel vs reference, full
#                                             # graphs vs eager, no compile after start-up) and the
#                                             # mixed-step A/B (full graph vs piecewise vs eager)
#   SITE=/path/to/vllm-site bash benchmarks/long_h200.sh vllm     # long_context.py online, vLLM 0.26 (~9 min)
#   bash benchmarks/long_h200.sh ours [--cudagraph-mode full]     # long_context.py online, pagedserve (~6 min;
#                                             # SITE=$T/deps without vLLM: device_deps.sh's server part)
#   SCENARIOS="len32k len100k" ... vllm|ours                      # only those scenarios (long_context.py --scenarios)
#   bash benchmarks/long_h200.sh collect      # -> benchmarks/results/h200/long_context.json
#   bash benchmarks/long_h200.sh sweep        # ~4 min: prefill_sweep.py, the long-chunk attention
#                                             # launches; $OUT/prefill_launch.env holds the picked switches
#                                             # (env $(cat $OUT/prefill_launch.env) bash ... ours)
#   bash benchmarks/long_h200.sh split        # ~3 min, 128-token pages: the two kernels' default launches,
#                                             # the prefill kernel's tma (+ws) launches, and torch SDPA
#                                             # (cuDNN, flash) over the gathered context, split into
#                                             # prefix + causal square (--split-baselines)
#   bash benchmarks/long_h200.sh decode_long   # ~6 min: the decode kernel at 1/2/4 sequences of 100k and of 33k tokens, plan variants
#   CONTEXTS=33000 bash benchmarks/long_h200.sh decode_long   # only those contexts (100000, 33000), no short rows
#   bash benchmarks/long_h200.sh decode_launches  # ~5 min: decode launches x splits x shares, CUDA-graph timed
#   bash benchmarks/long_h200.sh decode_mix    # ~1 min, kernel-only deps: the balanced decode's two grids (rows or
#                                             # slots, 41st session) on one 32k context among serving's at 8-64
#                                             # rows (decode_skew.py --long), then the decode GPU tests
#   bash benchmarks/long_h200.sh prefill_ab    # ~4 min: offline long prefills, default (on Hopper: the gathered
#                                             # path) vs PAGEDSERVE_LONG_PREFILL=off
# vllm/ours/collect share $OUT/long_context/ (the work dir); run them in one $OUT, or copy it over.
# On the device tool (which brings back 8 files of $OUT) set LONG_WORK=/tmp/long_context: the work dir
# stays there for the lease's later calls, and vllm/ours leave it in $OUT/long_context.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/logs}
mkdir -p "$OUT"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> "$OUT/progress.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$?" >> "$OUT/progress.log"
}
WORK=${LONG_WORK:-$OUT/long_context}
pack() { [ "$WORK" = "$OUT/long_context" ] || tar czf "$OUT/long_context.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")"; }
MODE=${1:-quick}
case $MODE in
  quick)
    step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/attention/test_unified_gpu.py \
      tests/runner/test_full_graphs_gpu.py tests/runner/test_warmup_gpu.py \
      -k "not test_no_compile or llama-False-True or full"
    step mixed_step_ab 270 python3 benchmarks/kernels/mixed_step_ab.py --output "$OUT/mixed_step_ab.json"
    ;;
  vllm)
    step long_context_vllm 590 python3 benchmarks/serving/long_context.py online --engines vllm \
      --site "${SITE:?set SITE to the dir vLLM 0.26 is installed in}" --work "$WORK" ${SCENARIOS:+--scenarios $SCENARIOS}
    pack ;;
  ours)
    shift
    step long_context_pagedserve 590 python3 benchmarks/serving/long_context.py online --engines pagedserve \
      --site "${SITE:?set SITE to the dir vLLM 0.26 is installed in (it supplies the server packages)}" --work "$WORK" \
      --pagedserve-args="$*" ${SCENARIOS:+--scenarios $SCENARIOS}  # '=': one flag alone would read as an option
    pack ;;
  collect)
    step long_context_collect 60 python3 benchmarks/serving/long_context.py collect --work "$WORK" \
      --device "NVIDIA H200"
    cp benchmarks/results/h200/long_context.json benchmarks/results/h200/long_context.md "$OUT/" 2>/dev/null
    ;;
  sweep)
    step prefill_sweep 280 python3 benchmarks/kernels/prefill_sweep.py --output "$OUT/prefill_sweep.json"
    python3 benchmarks/kernels/prefill_sweep.py --pick "$OUT/prefill_sweep.json" > "$OUT/prefill_launch.env" \
      2>> "$OUT/prefill_sweep.log"
    ;;
  split)
    l=paged_prefill:default,unified:default,paged_prefill:bm128+bn128+w8+s4+tma,paged_prefill:bm128+bn64+w8+s3+gqa+tma
    l=$l,paged_prefill:bm128+bn128+w8+s3+tma+ws,paged_prefill:bm128+bn64+w4+s2+gqa+tma+ws
    step prefill_split 280 python3 benchmarks/kernels/prefill_sweep.py --block-size 128 --launches "$l" \
      --split-baselines --reps 5 --output "$OUT/prefill_split.json"
    ;;
  prefill_ab)  # ~4 min, deps installed: offline start-up + 32k/100k/100k prefills, default vs
               # PAGEDSERVE_LONG_PREFILL=off (then any further "ENV=VALUE,..." given, e.g. a tma launch)
    shift
    step prefill_default 180 python3 benchmarks/serving/long_context.py prefill --out "$OUT/prefill_default.json"
    step prefill_off 180 env PAGEDSERVE_LONG_PREFILL=off python3 benchmarks/serving/long_context.py prefill \
      --out "$OUT/prefill_off.json"
    for extra in "$@"; do  # BLOCK=N in it: the engine's --block-size (tma needs pages of whole tiles)
      name=prefill_$(echo "$extra" | tr -c 'A-Za-z0-9\n' _ | cut -c1-60)
      step "$name" 180 env ${extra//,/ } bash -c 'python3 benchmarks/serving/long_context.py prefill \
        --block-size "${BLOCK:-16}" --out "$0"' "$OUT/$name.json"
    done ;;
  decode_long)  # ~6 min, kernel-only deps: the decode kernel at 1, 2 and 4 sequences of 100k (and 33k) tokens, its
                # share of copy bandwidth at the planned splits and at fixed ones (2026-12-03: the
                # plan's 512-544 programs sat just past a wave of ~396, whole waves were 10-24% faster,
                # docs/long-context.md), and the plan's variants (--shares: the balanced share at 2-8
                # programs per SM, and the one-wave plan) there and at 16 and 64 x 4096 tokens
    [[ " ${CONTEXTS:-100000 33000} " == *" 100000 "* ]] && for b in 1 2 4; do
      step "decode_long_b$b" 150 python3 benchmarks/kernels/bench_paged_decode.py --batch "$b" --context 100000 \
        --splits 12 16 24 32 48 64 96 128 --shares 2 3 4 6 8 --skip sweep,flex,blocks,prefill \
        --output "$OUT/decode_long_b$b.json"
    done
    # 32k contexts (the 35th session's "6.8 against 6.1 ms a step" compared gaps of different mixes:
    # classed alike, our decode steps matched vLLM's, docs/long-context.md, 2026-12-04)
    [[ " ${CONTEXTS:-100000 33000} " == *" 33000 "* ]] && for b in 1 2 4; do
      step "decode_32k_b$b" 150 python3 benchmarks/kernels/bench_paged_decode.py --batch "$b" --context 33000 \
        --splits 8 12 16 20 24 32 48 64 --shares 2 3 4 6 8 --skip sweep,flex,blocks,prefill \
        --output "$OUT/decode_32k_b$b.json"
    done
    [ -n "${CONTEXTS:-}" ] || for b in 16 64; do
      step "decode_short_b$b" 150 python3 benchmarks/kernels/bench_paged_decode.py --batch "$b" --context 4096 \
        --shares 2 3 4 6 8 --skip sweep,flex,blocks,prefill --output "$OUT/decode_short_b$b.json"
    done ;;
  decode_launches)  # ~5 min, kernel-only deps: decode launches (bn/w/s) x splits x plan shares, graph-timed,
                    # at 1/2/4 x 33k, 1/2 x 100k, and (launches and shares only) 16 and 64 x 4,096 tokens
    launches=${LAUNCHES:-"base bn64 bn64+s4 bn128+s2 w8"}
    for shape in 1x33000 2x33000 4x33000 1x100000 2x100000 16x4096 64x4096; do
      b=${shape%x*} L=${shape#*x}
      splits="--splits 8 16 24 32 48 64"; [ "$L" -lt 10000 ] && splits=""
      step "launches_${shape}" 120 python3 benchmarks/kernels/bench_paged_decode.py --batch "$b" --context "$L" \
        $splits --shares 4 6 8 --launches $launches --skip sweep,flex,blocks,prefill \
        --output "$OUT/launches_${shape}.json"
    done ;;
  decode_mix)
    step decode_skew_long 150 python3 benchmarks/kernels/decode_skew.py --num-seqs 8 16 32 64 \
      --split-tokens 0 balanced slots auto --max-model-len 40960 --long 32768 --output "$OUT/decode_skew_long.json"
    step gpu_decode_tests 150 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_gpu.py \
      -k "decode or split or balanced" ;;
  *) echo "usage: $0 quick|vllm|ours [pagedserve flags]|collect|sweep|split|prefill_ab|decode_long|decode_launches|decode_mix" >&2; exit 2 ;;
esac
echo "$(date +%T) done $MODE" >> "$OUT/progress.log"
