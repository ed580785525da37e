#!/usr/bin/env bash
# c8 + vLLM install, then the online side by side (u9.sh: vLLM then pagedserve, rates 10 20 40, step trace)
set -u
T=$(dirname "$(mktemp -u)"); mkdir -p $T/vc && cp -r .vllm-carry/c8 $T/vc/
bash $T/vc/c1/install_vllm.sh $T/vc > $OUT/install.log 2>&1; echo "install rc=$?"; tail -2 $OUT/install.log
LIMIT=500 bash .gpu/u9.sh
