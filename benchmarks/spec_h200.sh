#!/usr/bin/env bash
# Speculative decoding on the H200 (issue #36; benchmarks/offline/spec_decode_bench.py says what each
# section measures). Run from the repo root, one section per device call (each < 10 min).
#
# The quick plan: every target of the issue, both engines, two device calls (~13-14 device min with
# the machines' starts), then collect anywhere (no GPU needed):
#   timeout 540 bash benchmarks/spec_h200.sh quick_ours            # ~6 min, limit 9 (off 150 s + spec 380 s)
#   SITE=/dir/with/vllm timeout 540 bash benchmarks/spec_h200.sh quick_vllm   # ~6.5 min, limit 9
#   bash benchmarks/spec_h200.sh collect                           # the parts -> spec_decode.json
# quick_ours: two processes. (1) ours --config off, every batch: import ~10 s + engine ~50 s + 4
#   measurements (a generate of 2 and one of 128 tokens each: ~0.7 s at batch 1 to ~1.6 s at 128) -> ~70 s.
#   (2) ours --config spec --grid quick, every batch in one engine (target + draft = target, graphs for
#   both: ~70-90 s to start), 4 recordings, then 18 runs a batch = 72 runs (spec_plan says which). Run
#   cost from ~5.5 ms (batch 1) to ~10 ms (batch 128) a decode step: a k = 4 draft step is 4 draft
#   forwards + 1 verify + host (~30 ms at batch 1, ~65 ms at 128), a replay step 1 verify + host
#   (~8-25 ms); steps per 128 tokens at k = 4: a = 1 -> 26, 0.8 -> 38, 0.5 -> 66, 0 -> 128. That is
#   ~17 s of generates at batch 1, ~19 s at 8, ~26 s at 32, ~45 s at 128 (prefills included): ~110 s,
#   ~220 s if first-shape compiles and host work double it -> ~300-330 s in all. Tier 0 (the targets'
#   runs: adaptive x 4, k4_draft_a1, k4_replay_a1, k4_ngram) runs at every batch before tier 1 (the
#   sweep), and the part is rewritten after every run, so a cut keeps the targets.
# quick_vllm (needs vLLM 0.26 in $SITE): draft_model_k4, ngram_k4, off, each its own process (vLLM
#   cannot change its speculative config after start, and a process each lets one hang cost only its
#   own limit): import ~15 s + LLM 60-110 s (torch.compile + graphs; the draft's too) + 4 batches
#   (~5-10 s) each -> ~150 + ~120 + ~120 s = ~6.5 min; limits 240 + 150 + 140 s (the draft, which
#   compiles and captures two models, gets the most; off, the least needed for a target, runs last).
#   Logs: $OUT/vllm_quick.log.
# The full grid (below: ~25 + ~30 min) stays as it was.
#
# Every section:
#   bash benchmarks/spec_h200.sh tests                    # the draft proposer's tests (CUDA ones included)
#   bash benchmarks/spec_h200.sh off|spec_b1|spec_b8|spec_b32|spec_b128   # pagedserve, one engine each
#   SITE=/dir/with/vllm bash benchmarks/spec_h200.sh vllm_off|vllm_draft_model_k1|..._k4|vllm_ngram_k1|..._k4
#   bash benchmarks/spec_h200.sh collect                  # -> benchmarks/results/h200/spec_decode.json
#   bash benchmarks/spec_h200.sh ours_all | vllm_all      # every section of one side, one after another
#                                                          # (~25 / ~30 min: start detached, collect later)
# Parts land in benchmarks/results/h200/spec_decode_parts/ and in $OUT/spec_decode_parts/ (rewritten after
# every run), beside the progress log ($OUT/spec_progress.log); copy them back into the checkout's
# benchmarks/results/h200/spec_decode_parts/ before collect. A tree copied without .git needs `python -m pagedserve.benchmark.results stamp`
# in the checkout first (benchmarks/h200_run.sh says why).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
P=benchmarks/results/h200/spec_decode_parts
BENCH=benchmarks/offline/spec_decode_bench.py
LOG=${OUT:-.}/spec_progress.log
mkdir -p $P
run() {  # run NAME LIMIT ARGS...: one section under a time limit, logged
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> "$LOG"
  timeout "$limit" python3 $BENCH "$@" --parts $P
  local rc=$?
  echo "$(date +%T) end $name rc=$rc" >> "$LOG"
  return $rc
}
vllm_run() {  # vllm_run vllm_CONFIG [LIMIT]: vLLM from $SITE first on the path (its own torch);
              # pagedserve only for the result writer
  local cfg=${1#vllm_}
  [ -n "${SITE:-}" ] || { echo "set SITE to a directory with vLLM 0.26 installed" >&2; return 2; }
  PYTHONPATH=$SITE:$PWD run "$1" "${2:-580}" vllm --config "$cfg" --site "$SITE"
}
case "${1:-}" in
  tests) timeout 580 python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_model.py \
           tests/spec_decode/test_draft_greedy.py tests/spec_decode/test_spec_cuda.py 2>&1 | tee "${OUT:-.}/spec_tests.log" | tail -30 ;;
  off) run off 580 ours --config off ;;
  spec_b1|spec_b8|spec_b32|spec_b128) run "$1" 580 ours --config spec --batches "${1#spec_b}" ;;
  ours_all) run off 580 ours --config off
            for b in 1 8 32 128; do run spec_b$b 580 ours --config spec --batches $b; done ;;
  quick_ours) run off 150 ours --config off; rc1=$?
              run spec_quick 380 ours --config spec --grid quick; rc2=$?
              [ $rc1$rc2 = 00 ] ;;
  quick_vllm) VLOG=${OUT:-.}/vllm_quick.log
              vllm_run vllm_draft_model_k4 240 >> "$VLOG" 2>&1; rc1=$?
              vllm_run vllm_ngram_k4 150 >> "$VLOG" 2>&1; rc2=$?
              vllm_run vllm_off 140 >> "$VLOG" 2>&1; rc3=$?
              tail -c 4000 "$VLOG"; [ $rc1$rc2$rc3 = 000 ] ;;
  vllm_off|vllm_draft_model_k[0-9]|vllm_ngram_k[0-9]) vllm_run "$1" ;;
  vllm_all) for c in vllm_off vllm_draft_model_k1 vllm_draft_model_k2 vllm_draft_model_k4 \
                     vllm_ngram_k1 vllm_ngram_k2 vllm_ngram_k4; do vllm_run "$c"; done ;;
  collect) timeout 120 python3 $BENCH collect --parts $P ;;
  *) echo "usage: $0 quick_ours|quick_vllm|tests|off|spec_b1|spec_b8|spec_b32|spec_b128|ours_all|vllm_off|vllm_draft_model_kK|vllm_ngram_kK|vllm_all|collect" >&2
     exit 2 ;;
esac
rc=$?
# Each part is already in $OUT/spec_decode_parts/ (written after every run); copying the tree's parts
# folder too would bring back parts committed earlier and can pass $OUT's 8-file limit.
if [ -n "${OUT:-}" ] && [ "${1:-}" = collect ] && [ -f benchmarks/results/h200/spec_decode.json ]; then
  cp benchmarks/results/h200/spec_decode.json "$OUT/"
fi
exit $rc
