#!/usr/bin/env bash
# Prints the path of a folder holding Qwen's tokenizer, fetched once (scripts/fetch-tokenizer.sh).
exec bash "$(dirname "$0")/fetch-tokenizer.sh" qwen3
