#!/usr/bin/env bash
# Calls 2..7: one vLLM chunk each into $T/vc.
T=$(dirname "$(mktemp -u)"); mkdir -p $T/vc && cp -r .vllm-carry/$1 $T/vc/ && ls $T/vc && ls $T/site | wc -l; ls $T/incr_ok 2>&1
