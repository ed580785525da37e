# c7 + the GPU tests of this change (and the ones they sit beside)
source .gpu/common.sh
mkdir -p $T/vc && cp -r .vllm-carry/c7 $T/vc/ && P "c7 copied"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda_graph_sizes.py tests/engine/test_step_trace.py \
  tests/layers/test_sampling_gpu.py tests/engine/test_cuda_engine.py tests/runner/test_cuda_runner.py \
  tests/runner/test_release_graphs.py tests/runner/test_warmup_gpu.py tests/engine/test_cuda_piecewise.py > $OUT/gpu_tests.log 2>&1
P "gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
