#!/usr/bin/env bash
# Rebuilds the shipped PTX of draftsmith's CUDA kernels (draftsmith/decode/experimental/csrc/*.cu) with nvcc.
# The PTX is checked in: users need no CUDA toolkit (experimental/cluster_gemm.py assembles it with triton's ptxas).
# The .version line is lowered to 8.7 (CUDA 12.8) so older ptxas and drivers take it; the kernels use nothing newer.
set -euo pipefail
cd "$(dirname "$0")/../draftsmith/decode/experimental/csrc"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
for cu in *.cu; do
  "$NVCC" -arch=sm_90a -O3 -std=c++17 -ptx "$cu" -o "${cu%.cu}.ptx"
  sed -i 's/^\.version 9\.[0-9]*/.version 8.7/' "${cu%.cu}.ptx"
  echo "built ${cu%.cu}.ptx"
done
