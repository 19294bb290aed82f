#!/usr/bin/env bash
# Install the test environments and run the test suite. This is the README's test command and what
# CI runs. Two virtual environments:
#
#   .venv            CPU torch, jax[tpu] for deviceless TPU compiles, Tokamax, Transformers,
#                    huggingface_hub, and torchax. Only tests that start their own subprocess import
#                    torchax (importing it breaks torch.compile in that process).
#   .venv-torch-tpu  torch-tpu: it loads itself into every `import torch` and needs a newer libtpu
#                    than jax[tpu] pins, so it gets its own environment and runs the TorchTPU tests.
#
# With arguments, only `pytest ARGS` runs, in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt \
    -e ".[test,tpu,tokamax,hub,transformers,bench,torchax]"
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
if [ "$#" -eq 0 ]; then
    python3 -m venv .venv-torch-tpu
    .venv-torch-tpu/bin/python -m pip install --quiet --upgrade pip
    .venv-torch-tpu/bin/python -m pip install --quiet -c constraints.txt -e ".[test,tokamax,torch-tpu]"
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-torch-tpu/bin/python -m pytest tests/test_torch_tpu_runtime.py
fi
