#!/usr/bin/env bash
# Install the test environment into .venv (CPU torch, jax[tpu] for deviceless TPU compiles) and run
# the whole test suite. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,tpu,tokamax,hub,transformers,bench]"
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
