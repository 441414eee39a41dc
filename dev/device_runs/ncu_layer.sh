# Nsight Compute on one layer_qkv_attn_o launch at the 8B verify's shape (the device image has ncu at
# /usr/local/cuda/bin/ncu and allows its counters): the warp-state table, then the per-SASS-instruction stall samples
# as $OUT/sass.csv.gz (read with Python's csv: "Warp Stall Sampling (All Samples)" and the stall_* columns).
# Carry: .whl, dev/device_runs/ncu_layer.py comes with the tree. ~15 s + start.
set -u
. dev/device_runs/prelude.sh
timeout 300 ncu --clock-control none --target-processes all -k regex:layer_qkv_attn_o --launch-skip 2 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight -o "$OUT/layer" \
  python3 dev/device_runs/ncu_layer.py 2>&1 | tail -5
timeout 200 ncu -i "$OUT/layer.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
timeout 100 ncu -i "$OUT/layer.ncu-rep" --page details --section WarpStateStats --print-details all 2>&1 | tail -40
gzip "$OUT/sass.csv"
