#!/usr/bin/env bash
# Speculative decoding on the H200 (issue #36; benchmarks/offline/spec_decode_bench.py says what each
# section measures). Run from the repo root, one section per device call (each < 10 min):
#   bash benchmarks/spec_h200.sh tests                    # the draft proposer's tests (CUDA ones included)
#   bash benchmarks/spec_h200.sh off|spec_b1|spec_b8|spec_b32|spec_b128   # pagedserve, one engine each
#   SITE=/dir/with/vllm bash benchmarks/spec_h200.sh vllm_off|vllm_draft_model_k1|..._k4|vllm_ngram_k1|..._k4
#   bash benchmarks/spec_h200.sh collect                  # -> benchmarks/results/h200/spec_decode.json
#   bash benchmarks/spec_h200.sh ours_all | vllm_all      # every section of one side, one after another
#                                                          # (~25 / ~30 min: start detached, collect later)
# Parts land in benchmarks/results/h200/spec_decode_parts/ and are copied to $OUT with the progress log
# ($OUT/spec_progress.log). A tree copied without .git needs `python -m pagedserve.benchmark.results stamp`
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
vllm_run() {  # vLLM from $SITE first on the path (its own torch); pagedserve only for the result writer
  local cfg=${1#vllm_}
  [ -n "${SITE:-}" ] || { echo "set SITE to a directory with vLLM 0.26 installed" >&2; return 2; }
  PYTHONPATH=$SITE:$PWD run "$1" 580 vllm --config "$cfg" --site "$SITE"
}
case "${1:-}" in
  tests) timeout 580 python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_model.py \
           tests/spec_decode/test_draft_greedy.py tests/spec_decode/test_spec_cuda.py 2>&1 | tee "${OUT:-.}/spec_tests.log" | tail -30 ;;
  off) run off 580 ours --config off ;;
  spec_b1|spec_b8|spec_b32|spec_b128) run "$1" 580 ours --config spec --batches "${1#spec_b}" ;;
  ours_all) run off 580 ours --config off
            for b in 1 8 32 128; do run spec_b$b 580 ours --config spec --batches $b; done ;;
  vllm_off|vllm_draft_model_k[0-9]|vllm_ngram_k[0-9]) vllm_run "$1" ;;
  vllm_all) for c in vllm_off vllm_draft_model_k1 vllm_draft_model_k2 vllm_draft_model_k4 \
                     vllm_ngram_k1 vllm_ngram_k2 vllm_ngram_k4; do vllm_run "$c"; done ;;
  collect) timeout 120 python3 $BENCH collect --parts $P ;;
  *) echo "usage: $0 tests|off|spec_b1|spec_b8|spec_b32|spec_b128|ours_all|vllm_off|vllm_draft_model_kK|vllm_ngram_kK|vllm_all|collect" >&2
     exit 2 ;;
esac
rc=$?
if [ -n "${OUT:-}" ]; then
  cp -r $P "$OUT/" 2>/dev/null
  [ -f benchmarks/results/h200/spec_decode.json ] && cp benchmarks/results/h200/spec_decode.* "$OUT/" 2>/dev/null
fi
exit $rc
