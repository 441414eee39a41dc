# Sourced by the device-run scripts from the repository root: $OUT (the folder that comes back), the carried wheels
# (.whl: pydantic for the tests' imports) installed into /tmp/site on PYTHONPATH, and the GPU's name in gpu.txt.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
