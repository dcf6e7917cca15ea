#!/usr/bin/env bash
# Fetch, on a machine with pip access, the wheels the GPU benchmark needs on a device machine that has torch,
# transformers, accelerate, peft and safetensors but no TRL or datasets (docs/benchmarks.md, "GPU").
# Versions are the ones the CPU tables were measured with. .whl/ is git-ignored; the device tool carries it.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.23.0 peft==0.21.2
du -sh .whl
