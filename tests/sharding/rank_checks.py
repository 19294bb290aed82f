"""Checks scripts on every rank of a torchrun: ``torchrun --nproc-per-node N rank_checks.py
MODULE...`` (gloo, CPU) runs each module's ``CHECKS`` in one process group, each on a 1-D mesh
of every rank (its dimension named ``MESH_DIM`` where the module sets one); rank 0 prints one
JSON line per check.

Several scripts in one torchrun: each rank then imports torch, JAX and Transformers and loads
the kernels once, not once per script (the torch.distributed and 2-rank continuous-batching
checks: 67-69 CPU-s as two torchruns, 52-54 as one).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib
import json
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def run(modules: Sequence[ModuleType]) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for module in modules:
        dim = getattr(module, "MESH_DIM", None)
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=None if dim is None else (dim,))
        for fn in module.CHECKS:
            try:
                result = fn(mesh)
            except Exception:
                result = {"ok": False, "message": traceback.format_exc()[-3000:]}
            if rank == 0:
                print(json.dumps({"check": fn.__name__, **result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run([importlib.import_module(name) for name in sys.argv[1:]])
