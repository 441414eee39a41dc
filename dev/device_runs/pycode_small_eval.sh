#!/bin/bash
# `draftsmith eval --tune` on pycode-small with the drafter (dev/device_runs/README.md); eval.json comes back.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
tar xJf .carry8/small.tar.xz -C .carry8 || exit 1
/usr/bin/time -v timeout 330 python3 -m draftsmith eval --target .carry8/pycode-small --drafter .carry8/final --prompts .carry8/humaneval.jsonl \
  --limit 24 --max-new-tokens 200 --temperatures 0 --kernels triton --compile --draft-tokens 6 --tune --out /tmp/ev 2>&1 | grep -v Loading | tee $OUT/eval.log | tail -60
cp /tmp/ev/eval.json $OUT/ 2>/dev/null
timeout 90 python3 -m pytest -q --tb=short -p no:cacheprovider -m "gpu or not gpu" tests/gpu/test_decode_gpu.py \
  -k "triton_kernels_graph_rounds and compiled and tree" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -5 $OUT/tests.log
