#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch/transformers but no pydantic, datasets or
# speculators, and no network) into .whl/ for Python 3.12 x86_64. Used by the device runs in dev/DEVICE_RUNS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  typing-inspection==0.4.5 annotated-types==0.8.0 loguru==0.7.3 openai==3.57.0 httpx2==2.16.2 \
  httpcore2==2.16.2 truststore==0.10.5 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
du -sh .whl
