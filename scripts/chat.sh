#!/usr/bin/env bash
# One command from a fresh checkout to a real model answering on the CPU: builds the release
# binaries, fetches SmolLM2-135M-Instruct's GGUF (cached), compiles a bundle (cached), chats.
# Usage: scripts/chat.sh ["question"] [extra engrun generate flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
question="${1:-What is the capital of France?}"
shift || true
cargo build --release --bins --quiet
bin="${CARGO_TARGET_DIR:-target}/release"
gguf=$(scripts/fetch-smollm2.sh)
bundle="${ENGINE_CACHE:-$HOME/.cache/engine}/smollm2-135m-f32.bundle"
if [ ! -f "$bundle/manifest.json" ] || [ "$gguf" -nt "$bundle/manifest.json" ] || [ "$bin/engc" -nt "$bundle/manifest.json" ]; then
  # The tokenizer and chat template are the GGUF's own (engc builds them from its metadata).
  "$bin/engc" compile models/llama.yaml --checkpoint "$gguf" --dtype f32 -o "$bundle"
fi
exec "$bin/engrun" generate "$bundle" --device cpu --chat --max-tokens 128 --prompt "$question" "$@"
