#!/usr/bin/env bash
# Prepare a GPU check, here (PyPI reachable): the wheels the device lacks, into .whl/.
#
#   bash benchmarks/gpu_bundle.sh            # Python 3.12 wheels, for the device
#   PY=3.11 bash benchmarks/gpu_bundle.sh    # for a local dry run in a 3.11 environment
#
# Then one call of the device tool (the session's 15 device-minutes include the start):
#   run(carry=[".whl"], timeout_s=540, command="bash benchmarks/gpu_run.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
PIP=${PIP:-python3 -m pip}
rm -rf .whl && mkdir .whl
platforms=()
for n in 2_31 2_28 2_27 2_24 2_17 2_5; do platforms+=(--platform "manylinux_${n}_x86_64"); done
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl -r benchmarks/gpu-requirements.txt
ls .whl | wc -l | xargs echo "wheels:"
du -sh .whl
