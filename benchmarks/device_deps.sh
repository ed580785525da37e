#!/usr/bin/env bash
# pagedserve's runtime dependencies that the H200 image lacks (it has torch, Triton, transformers,
# numpy, safetensors): msgspec, pyzmq, pydantic (+ pydantic-core, annotated-types,
# typing-inspection) and xgrammar (+ apache-tvm-ffi). Without them `import pagedserve.LLM` fails on
# the device (the 24th session lost three calls finding that out one module at a time).
# .device-deps/server adds what `pagedserve serve` and its benchmark clients import beyond those
# (FastAPI, uvicorn and its C parser and loop, httpx, aiohttp, prometheus-client, jsonschema): with
# it, pagedserve's side of a serving benchmark needs no vLLM install (SITE=$T/deps).
#
# On a machine with the package index, from the repo root (writes git-ignored .device-deps/):
#   bash benchmarks/device_deps.sh download
# -> .device-deps/small (every wheel but xgrammar's, ~6 MiB) and .device-deps/x1, .device-deps/x2
# (xgrammar's 43 MiB wheel in two halves: a call's carry plus the tree must stay under 64 MiB),
# .device-deps/server (~9 MiB: a call of its own).
# On the device, one call per folder, carrying it, then in every later call of the same machine
# (small, x1 and x2 together are ~51 MB: one call carries all three where the tree it travels with
# is under ~16 MB, e.g. with history.tar.gz and the demo model's weights moved out for the call):
#   source benchmarks/device_deps.sh install     # gathers what this call carried into $T/deps-wheels,
#                                                 # installs once all parts are there, sets PYTHONPATH
set -u
T=$(dirname "$(mktemp -u)")
case "${1:-}" in
  download)
    rm -rf .device-deps && mkdir -p .device-deps/small .device-deps/x1 .device-deps/x2
    grep -qx "/.device-deps/" .git/info/exclude 2>/dev/null || echo "/.device-deps/" >> .git/info/exclude
    PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .device-deps/small \
      msgspec==0.22.0 pyzmq==27.2.0 pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 \
      typing-inspection==0.4.4 xgrammar==0.2.3 apache-tvm-ffi==0.1.10  # the set the 24th session ran
    x=$(ls .device-deps/small/xgrammar-*.whl) && split -n 2 -d "$x" .device-deps/x1/ && rm "$x"
    mv .device-deps/x1/01 .device-deps/x2/01 && echo "$(basename "$x")" > .device-deps/x1/NAME
    mkdir -p .device-deps/server
    PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .device-deps/server \
      fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.55.0 httptools==0.9.0 uvloop==0.23.0 \
      httpx==0.29.0 httpcore==1.0.9 anyio==4.16.0 h11==0.16.0 sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1 \
      prometheus-client==0.26.0 aiohttp==3.14.5 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 \
      yarl==1.25.1 propcache==0.5.4 attrs==26.1.0 aiohappyeyeballs==2.7.1 jsonschema==4.26.0 \
      referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 typing-extensions==4.16.0 \
      opentelemetry-api==1.45.3  # fastapi 0.165 imports it
    du -sh .device-deps/* ;;
  install)
    mkdir -p "$T/deps-wheels"
    for d in small x1 x2; do [ -d ".device-deps/$d" ] && cp ".device-deps/$d"/* "$T/deps-wheels/"; done
    if [ ! -d "$T/deps/xgrammar" ] && [ -f "$T/deps-wheels/00" ] && [ -f "$T/deps-wheels/01" ]; then
      w="$T/deps-wheels/$(cat "$T/deps-wheels/NAME")"
      cat "$T/deps-wheels/00" "$T/deps-wheels/01" > "$w"
      python3 -m pip install -q --no-deps --target "$T/deps" "$T"/deps-wheels/*.whl && echo "device deps installed in $T/deps"
    fi
    if [ -d .device-deps/server ] && [ ! -f "$T/deps/.server-installed" ]; then
      python3 -m pip install -q --no-deps --target "$T/deps" .device-deps/server/*.whl && touch "$T/deps/.server-installed" \
        && echo "server deps installed in $T/deps"
    fi
    [ -d "$T/deps/xgrammar" ] || echo "device deps: not all parts here yet (.device-deps/small, x1, x2)" >&2
    export PYTHONPATH=$T/deps${PYTHONPATH:+:$PYTHONPATH} ;;
  *) echo "usage: bash $0 download | source $0 install" >&2 ;;
esac
