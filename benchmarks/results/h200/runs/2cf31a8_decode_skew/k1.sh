# length-aware decode splits: GPU tests, then the skew microbenchmark
source .gpu/common.sh
P "start"
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_gpu.py -x > $OUT/gpu_tests.log 2>&1
P "attention gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
timeout 80 python3 benchmarks/decode_skew.py --split-tokens 0 512 1024 --output $OUT/decode_skew.json > $OUT/decode_skew.log 2>&1
P "skew rc=$?"; cat $OUT/decode_skew.log | cut -c1-400
