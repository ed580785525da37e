#!/usr/bin/env bash
# Speculative decoding on the H200 (issue #36; benchmarks/offline/spec_decode_bench.py says what each
# section measures). Run from the repo root, one section per device call (each < 10 min).
#
# Weights: every ours/vllm section loads ONE checkpoint, $SPEC_WEIGHTS (default /tmp/spec_ckpt): the
# bench's Llama-3.1-8B config written once by `spec_decode_bench.py checkpoint` (HF's seeded init, bf16,
# 16 GB in 5 GB safetensors shards) when the directory is absent, and reused by every later call on
# the same machine (a fresh machine writes it again). Both engines load it (load_format auto), and
# the draft model is the same directory. SPEC_WEIGHTS=dummy runs the old dummy weights instead (then
# collect sets no vLLM part against ours: the two engines' dummy weights are different models).
# The checkpoint on an H200 host: import torch + transformers ~10 s, init 8B params on the GPU ~2 s,
# save_pretrained 16 GB (GPU -> host copies, safetensors serialisation, writes into the page cache of
# a 128 GB host) ~20-60 s: ~30-70 s, limit 150. Loading it costs each engine ~5-15 s a copy (16 GB
# from the page cache; twice with the draft), where dummy weights cost ~1 s.
#
# The quick plan: every target of the issue, both engines, two device calls (~12-14 device min with
# the machines' starts), then collect anywhere (no GPU needed):
#   timeout 590 bash benchmarks/spec_h200.sh quick_ours     # ~5.5 min, limit 9.7 (ckpt 150 + off 120 + spec 310 s)
#   SITE=/dir/with/vllm timeout 590 bash benchmarks/spec_h200.sh quick_vllm   # ~6 min, limit 9.7
#   bash benchmarks/spec_h200.sh collect                           # the parts -> spec_decode.json
# (run each device call with timeout_s 600). Every (config, batch) starts with an untimed warm-up
# generate of the same batch (max_tokens 2): at 3368ebd a run's two-token generate took 0.5 s (batch 1)
# to 10 s (batch 128) summed over the 18 runs, so warm-ups add ~14 s to spec, ~1 s to off, ~2 s a vLLM config.
# quick_ours: the checkpoint if absent (~50 s, above), then two processes. (1) ours --config off, every
#   batch: import ~10 s + engine ~30 s (at 3368ebd, dummy) + the checkpoint's load ~10 s + 4 measurements
#   (a warm-up, a generate of 2 and one of 128 tokens each: ~0.7 s at batch 1 to ~1.7 s at 128) -> ~60 s.
#   (2) ours --config spec --grid quick, every batch in one engine (target + draft = target, graphs for
#   both: 19 s to start at 3368ebd, + ~20-30 s for two loads of the checkpoint), 4 recordings (~4 s),
#   then 18 runs a batch = 72 runs (spec_plan says which): at 3368ebd their timed generates took 17 s
#   (batch 1), 20 s (8), 27 s (32), 51 s (128) = 115 s, + 14 s of two-token ones, + ~14 s of warm-ups
#   -> ~200-230 s with the import. Tier 0 (the targets' runs: adaptive x 4, k4_draft_a1, k4_replay_a1,
#   k4_ngram) runs at every batch before tier 1 (the sweep), and the part is rewritten after every run,
#   so a cut keeps the targets.
# quick_vllm (needs vLLM 0.26 in $SITE): the checkpoint if absent (our python, not vLLM's), then
#   draft_model_k4, ngram_k4, off, each its own process (vLLM cannot change its speculative config after
#   start, and a process each lets one hang cost only its own limit): import ~15 s + LLM (at 3368ebd,
#   dummy: 98 s with the draft, 49-51 s without; torch.compile + graphs) + the checkpoint's loads (~10-15 s
#   each, twice with the draft) + 4 batches (~5-10 s) -> ~160 + ~80 + ~80 s = ~5.5 min, ~6.5 with the
#   checkpoint; limits 210 + 115 + 110 s (the draft, which compiles and captures two models, gets the
#   most; off, the least needed for a target, runs last). Logs: $OUT/vllm_quick.log.
# The full grid (below: ~25 + ~30 min) stays as it was, on the checkpoint too (each section writes
# it first if absent: 150 s more on a fresh machine).
#
# Every section:
#   bash benchmarks/spec_h200.sh checkpoint               # write $SPEC_WEIGHTS if absent (quick_* do it)
#   bash benchmarks/spec_h200.sh tests                    # the draft proposer's tests (CUDA ones included)
#   bash benchmarks/spec_h200.sh off|spec_b1|spec_b8|spec_b32|spec_b128   # pagedserve, one engine each
#   SITE=/dir/with/vllm bash benchmarks/spec_h200.sh vllm_off|vllm_draft_model_k1|..._k4|vllm_ngram_k1|..._k4
#   bash benchmarks/spec_h200.sh collect                  # -> benchmarks/results/h200/spec_decode.json
#   bash benchmarks/spec_h200.sh ours_all | vllm_all      # every section of one side, one after another
#                                                          # (~25 / ~30 min: start detached, collect later)
# Parts land in benchmarks/results/h200/spec_decode_parts/ and in $OUT/spec_decode_parts/ (rewritten after
# every run), beside the progress log ($OUT/spec_progress.log); copy them back into the checkout's
# benchmarks/results/h200/spec_decode_parts/ before collect. Each part records the weights it ran
# (collect compares only parts of one checkpoint). A tree copied without .git needs `python -m pagedserve.benchmark.results stamp`
# in the checkout first (benchmarks/h200_run.sh says why).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
P=benchmarks/results/h200/spec_decode_parts
BENCH=benchmarks/offline/spec_decode_bench.py
LOG=${OUT:-.}/spec_progress.log
CKPT=${SPEC_WEIGHTS:-/tmp/spec_ckpt}
if [ "$CKPT" = dummy ]; then W=(); else W=(--weights "$CKPT"); fi
mkdir -p $P
run() {  # run NAME LIMIT ARGS...: one section under a time limit, logged
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name" >> "$LOG"
  timeout "$limit" python3 $BENCH "$@" --parts $P
  local rc=$?
  echo "$(date +%T) end $name rc=$rc" >> "$LOG"
  return $rc
}
ckpt() {  # ckpt [LIMIT]: write the checkpoint unless it is there (a whole directory: written, then renamed)
  [ "$CKPT" = dummy ] || [ -d "$CKPT" ] || run checkpoint "${1:-150}" checkpoint --weights "$CKPT"
}
ours_run() {  # ours_run NAME LIMIT ARGS...: a pagedserve section on the checkpoint (written first if absent)
  local name=$1 limit=$2; shift 2
  ckpt || return $?
  run "$name" "$limit" ours "$@" ${W[@]+"${W[@]}"}
}
vllm_run() {  # vllm_run vllm_CONFIG [LIMIT]: vLLM from $SITE first on the path (its own torch);
              # pagedserve only for the result writer; the checkpoint written first if absent (our python)
  local cfg=${1#vllm_}
  [ -n "${SITE:-}" ] || { echo "set SITE to a directory with vLLM 0.26 installed" >&2; return 2; }
  ckpt || return $?
  PYTHONPATH=$SITE:$PWD run "$1" "${2:-580}" vllm --config "$cfg" --site "$SITE" ${W[@]+"${W[@]}"}
}
case "${1:-}" in
  tests) timeout 580 python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_model.py \
           tests/spec_decode/test_draft_greedy.py tests/spec_decode/test_spec_cuda.py 2>&1 | tee "${OUT:-.}/spec_tests.log" | tail -30 ;;
  checkpoint) ckpt ;;
  off) ours_run off 580 --config off ;;
  spec_b1|spec_b8|spec_b32|spec_b128) ours_run "$1" 580 --config spec --batches "${1#spec_b}" ;;
  ours_all) ours_run off 580 --config off
            for b in 1 8 32 128; do ours_run spec_b$b 580 --config spec --batches $b; done ;;
  quick_ours) ckpt 150 || exit $?
              ours_run off 120 --config off; rc1=$?
              ours_run spec_quick 310 --config spec --grid quick; rc2=$?
              [ $rc1$rc2 = 00 ] ;;
  quick_vllm) VLOG=${OUT:-.}/vllm_quick.log
              ckpt 150 >> "$VLOG" 2>&1 || { tail -c 4000 "$VLOG"; exit 1; }
              vllm_run vllm_draft_model_k4 210 >> "$VLOG" 2>&1; rc1=$?
              vllm_run vllm_ngram_k4 115 >> "$VLOG" 2>&1; rc2=$?
              vllm_run vllm_off 110 >> "$VLOG" 2>&1; rc3=$?
              tail -c 4000 "$VLOG"; [ $rc1$rc2$rc3 = 000 ] ;;
  vllm_off|vllm_draft_model_k[0-9]|vllm_ngram_k[0-9]) vllm_run "$1" ;;
  vllm_all) for c in vllm_off vllm_draft_model_k1 vllm_draft_model_k2 vllm_draft_model_k4 \
                     vllm_ngram_k1 vllm_ngram_k2 vllm_ngram_k4; do vllm_run "$c"; done ;;
  collect) timeout 120 python3 $BENCH collect --parts $P ;;
  *) echo "usage: $0 quick_ours|quick_vllm|checkpoint|tests|off|spec_b1|spec_b8|spec_b32|spec_b128|ours_all|vllm_off|vllm_draft_model_kK|vllm_ngram_kK|vllm_all|collect" >&2
     exit 2 ;;
esac
rc=$?
# Each part is already in $OUT/spec_decode_parts/ (written after every run); copying the tree's parts
# folder too would bring back parts committed earlier and can pass $OUT's 8-file limit.
if [ -n "${OUT:-}" ] && [ "${1:-}" = collect ] && [ -f benchmarks/results/h200/spec_decode.json ]; then
  cp benchmarks/results/h200/spec_decode.json "$OUT/"
fi
exit $rc
