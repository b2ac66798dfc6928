#!/usr/bin/env bash
# One-command setup: a Python 3.12 virtual environment with the project and its test extras.
#   bash setup.sh            -> ./.venv
#   bash setup.sh DIR        -> DIR (CI keeps one outside the clone, keyed by pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${1:-.venv}"
PY="${PYTHON312:-}"
if [ -z "$PY" ]; then
  if command -v pyenv >/dev/null && [ -x "$(pyenv root)/versions/3.12.1/bin/python" ]; then
    PY="$(pyenv root)/versions/3.12.1/bin/python"
  else
    PY="$(command -v python3.12)"
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/python" -c "import jax, flax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__)"
