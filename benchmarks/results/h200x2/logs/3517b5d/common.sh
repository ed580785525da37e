# sourced by every call: wheels, env, progress helper
set -u
T=$(dirname "$(mktemp -u)")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d $T/ps_site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/ps_site .whl/*.whl || echo "pip failed"
export PYTHONPATH=$PWD:$T/ps_site
P() { echo "$(date +%T) $*" | tee -a $OUT/progress.log; }
