#!/usr/bin/env bash
# Prints the path of a Python with the official `openai` package, for the server tests:
# a virtual environment created once in $ENGINE_CACHE/pyenv (default ~/.cache/engine/pyenv).
set -euo pipefail
env="${ENGINE_CACHE:-$HOME/.cache/engine}/pyenv"
if ! "$env/bin/python" -c "import openai" >/dev/null 2>&1; then
  echo "installing the openai package into $env" >&2
  python3 -m venv "$env" >&2
  "$env/bin/python" -m pip install --quiet --disable-pip-version-check "openai>=1.40,<3" >&2
fi
echo "$env/bin/python"
