# Sourced by the GPU scripts that measure a model shape on a few layers (scripts/gpu-gemms.sh,
# scripts/gpu-ncu.sh): the output folder ($OUT, default /tmp/gpu-out), the binaries ($BIN,
# default bin-gpu), the CUDA environment, and few_layer_bundle.
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
bin="${BIN:-bin-gpu}"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 ENGINE_CACHE_DIR=/tmp/engine-cache

# few_layer_bundle SHAPE QUANT: prints the path of a bundle of SHAPE (a config in
# tests/configs/) cut to LAYERS layers (default 4: every linear shape of the model, a fraction
# of the bytes), a random checkpoint made by HF transformers, compiled as it is (QUANT bf16) or
# with --quant QUANT by $bin's engc (a bundle carries its CUDA source); each is built once and
# kept under /tmp.
few_layer_bundle() {
  local shape=$1 q=$2
  local cfg=/tmp/gemms-$shape.json ck=/tmp/gemms-ck-$shape b=/tmp/gemms-$shape-$q.$(basename "$bin").bundle
  if [ ! -d "$b" ]; then
    python3 scripts/gpu/cut_layers.py "tests/configs/$shape.json" "${LAYERS:-4}" "$cfg"
    [ -f "$ck/config.json" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "$cfg" >/dev/null
    local model flag=()
    model=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_type"])' "$cfg")
    [ "$q" = bf16 ] || flag=(--quant "$q")
    "$bin/engc" compile "models/$model.yaml" --checkpoint "$ck" "${flag[@]}" -o "$b" >/dev/null
  fi
  echo "$b"
}
