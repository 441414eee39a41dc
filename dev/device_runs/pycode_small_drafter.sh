#!/bin/bash
# The pycode-small drafter (dev/device_runs/README.md): regenerate 32,768 greedy continuations + 2,000 online steps
# (examples/pycode-small.yaml cut to one call), with decode GPU tests alongside (training's speed is not measured here;
# TESTS_K: their -k expression over the kernel tests and tests/gpu/test_decode_gpu.py).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
tar xJf .carry8/small.tar.xz -C .carry8 || exit 1
SP=$(python3 -c "import transformers,os;print(os.path.dirname(os.path.dirname(transformers.__file__)))")
nvidia-smi --query-gpu=name,memory.total --format=csv
(
  t0=$(date +%s)
  python3 -m draftsmith regenerate --target .carry8/pycode-small --out runs/ps/regenerated.jsonl --continue-text \
    --data "$SP" --glob '**/*.py' --max-length 256 --max-samples 32768 --prefix-tokens 16:255 --max-new-tokens 192 \
    --temperature 0 --batch-size 1024 --cache dynamic --on-bad skip
  t1=$(date +%s); echo "REGEN $((t1-t0)) s"
  python3 -m draftsmith train --target .carry8/pycode-small --out runs/ps/train --online --max-length 2048 \
    --batch-tokens 32768 --ttt-steps 5 --steps 2000 --max-time 370 --draft-vocab-size 8192 --lr 0.001 \
    --save-dtype bf16 --quiet --data runs/ps/regenerated.jsonl
  echo "TRAIN $(( $(date +%s)-t1 )) s"
  tar cf $OUT/drafter.tar -C runs/ps/train final
  cp runs/ps/train/metrics.jsonl $OUT/ 2>/dev/null
  xz -T4 -c runs/ps/regenerated.jsonl > $OUT/regen.jsonl.xz
  echo TRAIN_DONE
) > $OUT/train.log 2>&1 &
TP=$!
timeout 280 python3 -m pytest -q --tb=short -p no:cacheprovider -m "gpu or not gpu" tests/unit/decode/test_decode_kernels.py tests/unit/decode/test_decode_kernels_engine.py \
  tests/gpu/test_decode_gpu.py -k "${TESTS_K:-embed or draft_step or triton_kernels}" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -25 $OUT/tests.log
timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m "gpu or not gpu" tests/unit/decode/test_decode_traced.py > $OUT/tests2.log 2>&1
echo "traced rc $?"; tail -15 $OUT/tests2.log
wait $TP
tail -30 $OUT/train.log
ls -la $OUT
