#!/usr/bin/env bash
# Prints a directory holding libnvrtc.so (NVIDIA's runtime compiler, from the PyPI wheel
# nvidia-cuda-nvrtc-cu12), for machines without the CUDA toolkit: CI compiles every generated
# kernel with it. Installed once into the venv of scripts/pyenv.sh.
set -euo pipefail
py=$("$(dirname "$0")/pyenv.sh")
env=$(dirname "$(dirname "$py")")
lib="$env/nvrtc-lib"
if [ ! -e "$lib/libnvrtc.so" ]; then
  echo "installing nvidia-cuda-nvrtc-cu12 into $env" >&2
  "$py" -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12>=12.4,<13" >&2
  src=$("$py" -c "import nvidia.cuda_nvrtc, os; print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], 'lib'))")
  mkdir -p "$lib"
  for f in "$src"/*.so*; do ln -sf "$f" "$lib/"; done
  ln -sf "$src/libnvrtc.so.12" "$lib/libnvrtc.so"
fi
echo "$lib"
