"""The one module kernels import from kernel-hub: a stable surface for kernel authors.

A kernel package (in-tree under ``kernels/``, shipped as ``kernel_hub/builtin/kernels/``, or a hub
build) may import from kernel-hub only this module; everything else inside ``kernel_hub`` may move
between releases. A kernel's manifest names the API version it needs,
``requires: {kernel-hub: ">=1.3"}``: that range is checked against ``API_VERSION`` (not the
package version) before the kernel is imported.

``API_VERSION`` follows semantic versioning: a minor bump adds names, a major bump removes or
changes one. Version 1.0 offers:

* the torch bridge: ``jax_op`` (JAX function -> torch custom op), ``op_namespace``, ``RowBuckets``;
* implementation tables: ``ImplementationTable``, ``Implementation``;
* input checks: ``check_dtype``, ``check_rank``, ``check_same_dtype``, ``dtype_name``,
  ``require``, ``FLOATS``, ``FLOATS_AND_F64``;
* platform queries: ``Platform``, ``jax_platform``, ``jax_default_device``, ``tpu_generation``;
* benchmark cases: ``KernelCase``, ``CPU_TAG``;
* errors: ``KernelHubError``, ``KernelInputError``, ``NoImplementationError``,
  ``UnsupportedDeviceError``.

Version 1.1 adds sharding: ``ShardingRule`` (an op's declarative rule), ``sharded`` (the
``shard_map`` boundary decorator for a kernel's public JAX functions), ``ShardingError``,
``MeshCase`` (a sharded compile case for ``compile-check --mesh``), ``find_mesh``,
``shard_map_all`` and ``partition_spec`` (for layers that are their own shard_map),
``exchange_rows`` / ``Transport`` (expert-parallel row exchange: ragged_all_to_all, or its
dense all_to_all emulation on CPU).

Version 1.2 adds ``jax_op(..., autocast=names)`` (inputs cast to the autocast dtype) and optional
(``Tensor | None``) differentiable arguments.

Version 1.3 adds the kernel declaration: ``KernelDeclaration`` (everything kernel-hub reads from a
kernel, exported by the kernel package as ``KERNEL``; see ``kernel_hub.declaration``) and
``submodule_loader`` (a lazily imported framework adapter). An adapter states ``register``,
``has_backward``, ``can_torch_compile`` and ``module_problem`` (None when it serves every module;
``FrameworkAdapter`` reads and checks them), a declared layer class ``has_backward`` and
``can_torch_compile``: nothing has a default. Builds for 1.0-1.2 (no declaration) are refused
before import, naming the API range they ask for: rebuild them against this module.

Version 1.3 also offers ``tiling`` (``kernel_hub.tpu_tiling``), the block-size rules Pallas TPU
kernels share instead of copying: ``tiling.sublane_multiple(dtype)`` (8 rows for 32-bit, 16 for
16-bit, 32 for 8-bit types), ``tiling.vmem_bytes_per_row(width, itemsize, streamed=...,
f32_temporaries=...)`` (what one row of a row block costs in VMEM), ``tiling.row_block(rows,
bytes_per_row, dtype)`` (the largest legal row block within ``tiling.VMEM_BUDGET_BYTES``),
``tiling.row_block_problem(rows, block_rows, dtype)`` (why a user's block is illegal),
``tiling.vmem_budget(generation, reserve=...)`` (what any kernel's blocks may plan to use on a
generation), ``tiling.chunk_problem(chunk)`` (why a chunked scan's chunk is illegal) and
``tiling.compiler_params("parallel", "arbitrary", ...)`` (Mosaic's compiler parameters).
With them: ``pallas_and_xla(op, pallas, xla, pallas_problem)`` (the table of an op with a Pallas
kernel and an XLA path, in the ``PALLAS_FIRST_ON_TPU`` order) and ``float64_problem(*arrays)``
(float64 reaches a Pallas kernel only in interpret mode).
A row-wise kernel states only its own numbers (its streamed blocks and live f32 temporaries);
see kernels/rmsnorm/rmsnorm/pallas_tpu.py.

Version 1.3 also offers option dataclasses (``kernel_hub.options``): a kernel declares its static
options once, as a frozen dataclass, and derives its JAX functions' keyword parameters
(``takes_options``) from it, and passes an instance
on as keywords (``option_values``); attention-like kernels share the value rules of the score
options causal/sliding_window/softcap/scale (``check_score_options``) and their resolved values
(``resolved_scores``); and ``SavedBackward``, a ``jax_op`` backward taking the
tensors, outputs and cotangents positionally, which ``jax_op`` checks by name against the stub
as it checks the forward.

Version 1.3 also offers ``weight_formats`` (``kernel_hub.weight_formats``): the quantized weight
formats kernels share (int8 per output channel, fp8 e4m3 in 128 x 128 blocks, in Transformers'
``[E, out, in]`` expert layout): ``dequantize`` (what a quantized weight stands for) and
``fp8_block_scales`` (one weight block's block scales, picked in VMEM by a Pallas kernel).
And ``transformers_ep`` (``kernel_hub.transformers_ep``), what an experts module under
Transformers' expert-parallel plan looks like to an integration: ``dispatches`` (the plan
dispatches its tokens) and ``unsplit`` (the parameters it left whole).

Version 1.5 adds the op declaration: ``op`` (a decorator of a kernel's public JAX function that
derives its input check, its ``shard_map`` boundary and its torch custom op, schema and DTensor
strategies included, from the one typed signature; see ``kernel_hub.bridge.declared_op``) and
``Einsum`` (a sharding rule's text, named by the op it is declared on). Kernels declared this way
have no ``torch_ops.py`` stubs and no ``sharding.py`` boundary modules. Every in-tree kernel is;
``option_stub`` (1.3's derived stub signature) is gone with the last stub that used it.

Version 1.7 adds value checks that never stall an accelerator: ``host_values`` (an argument's
elements when they are already on the host: numpy, CPU JAX arrays, eager CPU torch tensors; else
None), ``check_int32_values`` (integer indices a kernel reads as int32: a wider value is
refused, not wrapped into another id; it returns the values it read, for further checks) and
``check_offset_values`` (packed sequences' offsets: 0 first, the token count last, never
decreasing); and ``op(check_values=...)``, a check that
runs on every call of the JAX function and the torch op (``check`` runs once per signature in
the torch op's eager calls, so it may look only at shapes and dtypes).
"""

from __future__ import annotations

import kernel_hub.tpu_tiling as tiling
import kernel_hub.transformers_ep as transformers_ep
import kernel_hub.weight_formats as weight_formats

from .bench.cases import CPU_TAG, KernelCase
from .bridge.buckets import RowBuckets
from .bridge.declared_op import op
from .bridge.torch_op import SavedBackward, jax_op, op_namespace
from .checks import (
    FLOATS,
    FLOATS_AND_F64,
    check_dtype,
    check_int32_values,
    check_offset_values,
    check_rank,
    check_same_dtype,
    dtype_name,
    host_values,
    require,
)
from .declaration import FrameworkAdapter, KernelDeclaration, submodule_loader
from .dispatch import (
    PALLAS_FIRST_ON_TPU,
    Implementation,
    ImplementationTable,
    float64_problem,
    pallas_and_xla,
)
from .errors import KernelHubError, KernelInputError, NoImplementationError, UnsupportedDeviceError
from .options import (
    check_score_options,
    option_values,
    resolved_scores,
    takes_options,
)
from .platform import Platform, jax_default_device, jax_platform, tpu_generation
from .sharding import (
    Einsum,
    MeshCase,
    ShardingError,
    ShardingRule,
    Transport,
    exchange_rows,
    find_mesh,
    partition_spec,
    shard_map_all,
    sharded,
)
from .version import KERNEL_API_VERSION

API_VERSION = KERNEL_API_VERSION

__all__ = [
    "API_VERSION",
    "CPU_TAG",
    "FLOATS",
    "FLOATS_AND_F64",
    "PALLAS_FIRST_ON_TPU",
    "Einsum",
    "FrameworkAdapter",
    "Implementation",
    "ImplementationTable",
    "KernelCase",
    "KernelDeclaration",
    "KernelHubError",
    "KernelInputError",
    "MeshCase",
    "NoImplementationError",
    "Platform",
    "RowBuckets",
    "SavedBackward",
    "ShardingError",
    "ShardingRule",
    "Transport",
    "UnsupportedDeviceError",
    "check_dtype",
    "check_int32_values",
    "check_offset_values",
    "check_rank",
    "check_same_dtype",
    "check_score_options",
    "dtype_name",
    "exchange_rows",
    "find_mesh",
    "float64_problem",
    "host_values",
    "jax_default_device",
    "jax_op",
    "jax_platform",
    "op",
    "op_namespace",
    "option_values",
    "pallas_and_xla",
    "partition_spec",
    "require",
    "resolved_scores",
    "shard_map_all",
    "sharded",
    "submodule_loader",
    "takes_options",
    "tiling",
    "tpu_generation",
    "transformers_ep",
    "weight_formats",
]
