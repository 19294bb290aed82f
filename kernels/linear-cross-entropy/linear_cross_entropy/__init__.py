"""linear-cross-entropy kernel: ``linear_cross_entropy`` (the torch loss, see ``torch_api``), the
torch ops ``linear_cross_entropy_per_token`` and ``loss_only`` (the op named
``linear_cross_entropy``), ``jax.linear_cross_entropy``, and the Transformers causal-LM
integration (``integrations``)."""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark
from .torch_api import linear_cross_entropy, linear_cross_entropy_per_token, loss_only

KERNEL = KernelDeclaration(
    ops={
        "linear_cross_entropy": loss_only,
        "linear_cross_entropy_per_token": linear_cross_entropy_per_token,
    },
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "jax",
    "linear_cross_entropy",
    "linear_cross_entropy_per_token",
    "loss_only",
]
