#!/usr/bin/env bash
# decode kernel launch variants; the fixed256 decode step's kernels (Llama-3.1-8B, 1000 seqs)
source .gpu/common.sh
R=$OUT/p2; mkdir -p $R
P "start p2"
timeout 260 python3 benchmarks/decode_variants.py --output $R/decode_variants.json > $R/variants.log 2>&1; P "variants rc=$?"
timeout 170 python3 benchmarks/profile_decode.py --cuda-graphs --model benchmarks/models/llama-3.1-8b --num-seqs 1000 --prompt-len 256,256 --temperature 0.6 --steps 5 --output $R/profile_decode_llama_n1000_fixed256.json > $R/profile1000.log 2>&1; P "profile1000 rc=$?"
tar czf $OUT/p2.tgz -C $OUT p2
grep -v "^{" $R/variants.log | cut -c1-600 | tail -12
grep -A22 "^fused" $R/profile1000.log | head -24
cat $R/profile_decode_llama_n1000_fixed256.md 2>/dev/null | head -30
