"""A kernel's JAX function lowered for TPU at fixed input shapes, and the Mosaic kernels inside it.

Each Pallas TPU kernel lowers to a ``tpu_custom_call`` whose ``backend_config`` carries the Mosaic
module (the payload TPU compilers take). A kernel-hub op is more than one such call (reshapes, a
reduction, forward and backward kernels), so a runtime embeds the whole lowered program (``hlo``),
payloads included; ``kernels`` lists the payloads so callers and tests can see what will run.
Lowering needs no TPU: it runs on any host with jaxlib.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .tpu_target import tracing_for_tpu

MOSAIC_CALL_TARGET = "tpu_custom_call"
_MLIR_BYTECODE_MAGIC = b"ML\xefR"


@dataclass(frozen=True)
class MosaicKernel:
    """One Pallas TPU kernel in a lowered program: its name and the custom call's payload."""

    name: str
    backend_config: str

    def mosaic_bytecode(self) -> bytes:
        """The serialized Mosaic module inside the payload (MLIR bytecode)."""
        config = json.loads(self.backend_config)["custom_call_config"]
        body = base64.b64decode(config["body"])
        if not body.startswith(_MLIR_BYTECODE_MAGIC):
            raise ValueError(f"kernel {self.name}: payload body is not MLIR bytecode")
        return body


@dataclass(frozen=True, eq=False)
class TpuProgram:
    """A JAX function lowered for one TPU and one input signature; compared by identity."""

    name: str
    hlo_module: bytes
    """Serialized ``HloModuleProto``; parameters are the non-None input tensors in order."""
    out_tree: Any
    out_avals: tuple[Any, ...]
    kernels: tuple[MosaicKernel, ...]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str


Signature = tuple[Any, ...]
"""Per tensor argument: a ``TensorSpec``, None, or a tuple of those (a list argument)."""


def tensor_signature(tensors: Any) -> Signature:
    """The hashable shapes and dtypes of tensors, lists of tensors and Nones."""
    if isinstance(tensors, (list, tuple)):
        return tuple(tensor_signature(item) for item in tensors)
    if tensors is None:
        return None
    return TensorSpec(tuple(int(size) for size in tensors.shape), _dtype_name(tensors.dtype))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def abstract_arrays(signature: Signature) -> Any:
    """``jax.ShapeDtypeStruct``s (lists for list arguments, None kept) for a signature."""
    import jax

    if isinstance(signature, tuple):
        return [abstract_arrays(entry) for entry in signature]
    if signature is None:
        return None
    return jax.ShapeDtypeStruct(signature.shape, jax.numpy.dtype(signature.dtype))


@functools.cache
def program_for(
    jax_fn: Callable[..., Any], signature: Signature, device_name: str, name: str
) -> TpuProgram:
    """Lower ``jax_fn`` for the TPU ``device_name`` at ``signature``; cached per arguments."""
    import jax

    structs = abstract_arrays(signature)
    leaves, in_tree = jax.tree.flatten(structs)
    out_trees = []

    def flat_fn(*flat_inputs):
        outputs = jax_fn(*jax.tree.unflatten(in_tree, flat_inputs))
        flat_outputs, out_tree = jax.tree.flatten(outputs)
        out_trees.append(out_tree)
        return flat_outputs

    # Mosaic asks which chip it lowers for (tpu_info) while lowering, not only while tracing.
    with tracing_for_tpu(device_name):
        traced = jax.jit(flat_fn, keep_unused=True).trace(*leaves)
        lowered = traced.lower(lowering_platforms=("tpu",))
    return TpuProgram(
        name=name,
        hlo_module=lowered.compiler_ir("hlo").as_serialized_hlo_module_proto(),
        out_tree=out_trees[-1],
        out_avals=tuple(traced.out_info),
        kernels=mosaic_kernels(lowered.compiler_ir("stablehlo")),
    )


def mosaic_kernels(module: Any) -> tuple[MosaicKernel, ...]:
    """Every ``tpu_custom_call`` in a StableHLO module (an ``ir.Module``), in program order."""
    from jax._src.lib.mlir import ir  # the MLIR bindings JAX's lowering returns

    kernels = []
    for op in _operations(module.operation):
        if op.name != "stablehlo.custom_call":
            continue
        attributes = op.attributes
        if ir.StringAttr(attributes["call_target_name"]).value != MOSAIC_CALL_TARGET:
            continue
        name = ir.StringAttr(attributes["kernel_name"]).value if "kernel_name" in attributes else ""
        kernels.append(MosaicKernel(name, ir.StringAttr(attributes["backend_config"]).value))
    return tuple(kernels)


def mosaic_kernels_in_text(mlir_text: str) -> tuple[MosaicKernel, ...]:
    """``mosaic_kernels`` of a StableHLO module given as text (e.g. ``jax.export``'s)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        return mosaic_kernels(ir.Module.parse(mlir_text))


def _operations(operation: Any) -> Iterator[Any]:
    for region in operation.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _operations(inner)
