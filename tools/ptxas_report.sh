#!/usr/bin/env bash
# Registers, stack frame and spills of every kernel in a kit's CUDA source, as ptxas reports them (no GPU needed).
#   tools/ptxas_report.sh kernels/distill.cu [name-filter]
# Compiles with torch's include paths and the kit's flags for sm_90. A non-zero stack frame in a hot kernel
# usually means an array indexed at run time went to local memory.
set -euo pipefail
src=${1:?a .cu file}; filter=${2:-.}
py=${PYTHON:-python3}
inc=$($py -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-isystem ' + p for p in c.include_paths('cuda') + [sysconfig.get_paths()['include']]))" 2>/dev/null)
std=$($py -c "import torch; print('c++20' if tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 14) else 'c++17')")
nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
$nvcc -std=$std -O3 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 -Xptxas -v $inc \
  -I"$(dirname "$src")" -c "$src" -o /dev/null 2>&1 |
  grep -E "Compiling entry|Used|stack frame" | sed 's/ptxas info    : //' | paste - - - |
  sed -E "s/Compiling entry function '([^']*)'.*\t *([0-9]+ bytes stack frame), ([0-9]+ bytes spill stores).*\t(Used [0-9]+ registers).*/\2 \3 \4  \1/" |
  while read -r line; do name=$(echo "$line" | awk '{print $NF}'); printf '%s  %s\n' "${line% *}" "$(echo "$name" | c++filt)"; done |
  grep -E "$filter" || true
