"""Where a model-bench step's arguments live: one chip, or a multi-chip mesh sharded the way
Transformers' tensor-parallel (and expert-parallel) plans shard the model, with FSDP over the chips
the plans leave.

The mesh is a deviceless topology of the generation (``v5e:2x2``, ``v5e:4x4``, ...) with two
Auto axes, ``fsdp`` x ``model`` (``chips / tp`` x ``tp``):

* ``model``: the model's own TP plan (``model._tp_plan``, what ``from_pretrained(tp_plan="auto")``
  applies): a ``colwise`` linear splits its output features (weight dim 0 and its bias), a
  ``rowwise`` one its input features (the weight's last dim), ``embedding_rowwise`` the
  vocabulary rows, ``colwise_gather_output`` (the LM head) its output features,
  ``replicated_with_grad_allreduce`` nothing. A model with an expert-parallel plan
  (``model._ep_plan``: Qwen3-MoE, GPT-OSS, Qwen3-Next) has its experts split by that plan over the
  same chips, as Transformers does when a ``DistributedConfig`` asks for both (the EP plan's
  entries replace the TP plan's on the experts modules and their parameters): ``grouped_gemm``
  splits an expert weight's experts (dim 0) over ``model`` and then ``fsdp`` (expert parallelism
  over every chip: ``Placement.experts_axes``), ``ep_dispatch_experts`` (the experts module)
  nothing of its own. A plan style this table does not know is an error, not a guess. With
  ``--tp 1`` the ``model`` axis is one chip and no plan is read: FSDP alone.
* ``fsdp``: every other weight's first dimension the plan leaves whole and ``fsdp`` divides, as
  FSDP shards a flat parameter (gathered by the partitioner where it is used); the batch of the
  step's inputs and of a static KV cache, when ``fsdp`` divides it.

A static KV cache ``[B, Hkv, C, D]`` splits its heads over ``model``, as the TP plan's k/v
projections split them. Everything else is replicated. The compiled program is one SPMD program:
its ``memory_analysis`` and ``cost_analysis`` are one chip's.

The kernels' ``shard_map`` boundaries place their inputs by the mesh-axis conventions
(``sharding.CONVENTIONAL_AXES``: ``batch`` and the rows of row-wise ops over ``fsdp``, heads and
vocabulary over ``model``), except in a decode step (``kernel_axis_rules``), whose rows stay
whole: a decode step's rows are its few new tokens, and a boundary that splits them over
``fsdp`` makes the partitioner gather every FSDP-split weight of the linears between two
kernels (FSDP's weight all-gather, per layer) instead of moving the tokens. A prefill step with
expert-split weights keeps the conventions and adds ``experts`` over ``experts_axes``
(``kernel_mesh``), so fused-moe runs each chip's experts where its weights are.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernel_hub.errors import KernelInputError

MESH_AXES = ("fsdp", "model")
_TOPOLOGY = re.compile(r"\d+(x\d+){1,2}")

PARAMETER = ""
"""The key of a style's own dimension in ``PLAN_STYLE_DIM``, for a plan entry that names a
parameter (``layers.*.mlp.experts.gate_up_proj``) rather than a module."""

PLAN_STYLE_DIM: Mapping[str, Mapping[str, int | None]] = {
    "colwise": {"weight": 0, "bias": 0},
    "colwise_gather_output": {"weight": 0, "bias": 0},
    "rowwise": {"weight": -1, "bias": None},
    "embedding_rowwise": {"weight": 0},
    "replicated_with_grad_allreduce": {},  # Qwen3-MoE's q/k norms: whole on every TP chip
    "grouped_gemm": {PARAMETER: 0},  # EP plan: an expert weight or bias, split by expert
    "ep_dispatch_experts": {},  # EP plan: the experts module; its parameters have entries
}
"""Transformers' TP or EP plan style -> the dimension of each parameter it splits over ``model``
(None: replicated)."""
EXPERT_STYLES = frozenset({"grouped_gemm"})
"""EP plan styles: their dimension splits over ``Placement.experts_axes``, no other dimension
over ``fsdp``."""


def topology_chips(topology: str) -> int:
    """Chips of a topology shape such as ``2x2`` or ``4x4``."""
    if not _TOPOLOGY.fullmatch(topology):
        raise KernelInputError(
            f"--topology {topology!r}: expected a chip grid such as 2x2 or 4x4 (v5e, v6e) or "
            "2x2x1 (v4, v5p)"
        )
    return math.prod(int(n) for n in topology.split("x"))


@dataclass(frozen=True)
class Placement:
    """The device tracing runs under and, on a mesh, the mesh and the model's TP plan (with its
    EP plan's entries)."""

    device: Any
    mesh: Any | None = None
    plan: Mapping[str, str] | None = None  # None on a mesh: FSDP alone (``--tp 1``)

    @property
    def splits_experts(self) -> bool:
        """Whether the plan splits experts over ``model`` (the model's EP plan)."""
        return bool(EXPERT_STYLES & set((self.plan or {}).values()))

    @property
    def chips(self) -> int:
        return 1 if self.mesh is None else self.mesh.devices.size

    def _sharding(self, spec: Sequence[str | None]) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

        if self.mesh is None:
            return SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def _divides(self, axis: str, size: int) -> bool:
        return size % self.mesh.shape[axis] == 0

    @property
    def experts_axes(self) -> tuple[str, ...]:
        """The mesh axes an expert weight's experts split over under the EP plan: ``model`` and
        then ``fsdp`` (expert parallelism over every chip, so each chip reads only its own
        experts whole: split over ``fsdp`` on another dimension, a kernel that needs its experts
        whole would gather them every layer)."""
        return ("model", "fsdp") if self.mesh.shape["fsdp"] > 1 else ("model",)

    def weight(self, name: str, shape: Sequence[int], fsdp: bool = True) -> Any:
        """The sharding of the parameter or buffer ``name`` (``fsdp``: split over the FSDP axis
        too; buffers are not)."""
        spec: list[str | tuple[str, ...] | None] = [None] * len(shape)
        if self.mesh is None or not shape:
            return self._sharding(spec)
        style, dim = _plan_entry(self.plan or {}, name)
        if style in EXPERT_STYLES:
            axes = self.experts_axes
            chips = math.prod(self.mesh.shape[a] for a in axes)
            if shape[dim] % chips:
                raise KernelInputError(
                    f"{name} {tuple(shape)}: its EP plan splits its {shape[dim]} experts over "
                    f"{chips} chips ({' x '.join(axes)}), which do not divide them; choose a "
                    "topology whose chips divide the model's experts"
                )
            spec[dim] = axes
            return self._sharding(spec)
        if dim is not None:
            if not self._divides("model", shape[dim]):
                raise KernelInputError(
                    f"{name} {tuple(shape)}: its TP plan splits dim {dim} over "
                    f"{self.mesh.shape['model']} chips, which do not divide it; choose a --tp that "
                    "divides the model's heads, KV heads and widths"
                )
            spec[dim] = "model"
        if fsdp and self.mesh.shape["fsdp"] > 1:
            free = [d for d in range(len(shape)) if spec[d] is None]
            for d in free:
                if self._divides("fsdp", shape[d]):
                    spec[d] = "fsdp"
                    break
        return self._sharding(spec)

    def batch(self, shape: Sequence[int], heads_dim: int | None = None) -> Any:
        """An input or cache tensor: its batch (dim 0) over ``fsdp`` when that divides it, its
        ``heads_dim`` over ``model`` (a static KV cache's heads) when that divides it."""
        spec: list[str | None] = [None] * len(shape)
        if self.mesh is not None and shape:
            if self._divides("fsdp", shape[0]):
                spec[0] = "fsdp"
            if heads_dim is not None and self._divides("model", shape[heads_dim]):
                spec[heads_dim] = "model"
        return self._sharding(spec)

    def kernel_axis_rules(self, mode: str, batch: int) -> dict[str, str | None] | None:
        """``use_mesh`` rules for the kernels' boundaries in a ``mode`` step of ``batch``
        sequences, or None (one chip, or the mesh-axis conventions: train, prefill).

        Decode: the conventions less their row rule. ``batch`` (attention's and rotary's) over
        ``fsdp`` as the static cache is placed (when ``fsdp`` divides it); heads, KV heads,
        channels, the gated MLP's intermediate features and vocabulary over ``model``; no rule
        for ``...``, so the rows of row-wise
        ops (rms_norm, the gated MLP's product) stay whole and the linears between kernels keep
        their weights in place. ``experts`` over ``experts_axes`` when the EP plan splits them:
        the fused experts kernel then runs each chip's own experts (expert parallelism)."""
        if self.mesh is None or mode != "decode":
            return None
        rules: dict[str, str | tuple[str, ...] | None] = dict.fromkeys(
            ("heads", "kv_heads", "channels", "intermediate", "vocab"), "model"
        )
        if self.splits_experts:
            rules["experts"] = self.experts_axes
        return {"batch": "fsdp" if self._divides("fsdp", batch) else None, **rules}

    def kernel_mesh(self, mode: str, batch: int) -> contextlib.AbstractContextManager[Any]:
        """The ``use_mesh`` region a ``mode`` step is traced in: the decode rules
        (``kernel_axis_rules``); for a prefill step whose EP plan splits the experts, the
        mesh-axis conventions plus ``experts`` over ``experts_axes`` (fused-moe runs each chip's
        experts on every token); else none, so the conventions apply. A training step's experts
        run moe-gemm, whose rule keeps them whole (its expert parallelism is ``moe_ep``)."""
        from kernel_hub.sharding import use_mesh

        rules = self.kernel_axis_rules(mode, batch)
        if rules is not None:
            return use_mesh(self.mesh, rules)
        if self.mesh is not None and mode == "prefill" and self.splits_experts:
            return use_mesh(self.mesh, {"experts": self.experts_axes}, over_conventions=True)
        return contextlib.nullcontext()

    def describe(self) -> str | None:
        if self.mesh is None:
            return None
        fsdp, model = (self.mesh.shape[a] for a in MESH_AXES)
        if not self.plan:
            how = "FSDP alone (--tp 1: the TP plan is not read)"
        elif self.splits_experts:
            how = (
                "Transformers' TP plan over model and EP plan (experts) over "
                f"{' x '.join(self.experts_axes)}, FSDP over fsdp"
            )
        else:
            how = "Transformers' TP plan over model, FSDP over fsdp"
        return (
            f"sharded over {self.chips} chips (mesh fsdp {fsdp} x model {model}): {how}; peak "
            "HBM, bytes and FLOPs are one chip's, and the roofline leaves out the collectives' "
            "ICI time"
        )


def _plan_entry(plan: Mapping[str, str], name: str) -> tuple[str | None, int | None]:
    """The plan style of parameter ``name`` and the dimension it splits (None: none); an entry
    naming the parameter itself first, else one naming its module."""
    module, _, leaf = name.rpartition(".")
    for target, key in ((name, PARAMETER), (module, leaf)):
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(target, pattern):
                if style not in PLAN_STYLE_DIM:
                    raise KernelInputError(
                        f"{target}: plan style {style!r} is not one model-bench shards; it knows "
                        f"{', '.join(sorted(PLAN_STYLE_DIM))}"
                    )
                return style, PLAN_STYLE_DIM[style].get(key)
    return None, None


def model_plan(model: Any) -> dict[str, str]:
    """The model's TP plan with its EP plan's entries, which replace the TP plan's on the experts
    modules and their parameters (Transformers' precedence when both are asked for)."""
    tp_plan = dict(getattr(model, "_tp_plan", None) or {})
    ep_plan = dict(getattr(model, "_ep_plan", None) or {})
    if not ep_plan:
        return tp_plan
    is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
    return {k: v for k, v in tp_plan.items() if not is_expert(k)} | ep_plan


def placement(generation: str, topology: str | None, tp: int | None, model: Any) -> Placement:
    """One chip of ``generation`` (no topology) or a mesh over every chip of
    ``generation:topology`` with ``tp`` chips (default: all) on the ``model`` axis."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from kernel_hub.topologies import tpu_device, tpu_devices

    if topology is None:
        if tp not in (None, 1):
            raise KernelInputError(f"--tp {tp} needs a multi-chip --topology")
        return Placement(tpu_device(generation))
    chips = topology_chips(topology)
    tp = chips if tp is None else tp
    if tp < 1 or chips % tp:
        raise KernelInputError(f"--tp {tp} must divide the {chips} chips of {topology}")
    devices = tpu_devices(generation, topology)
    mesh = Mesh(
        np.array(devices).reshape(chips // tp, tp),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )
    if tp == 1:  # one chip on ``model``: the plan would split nothing, so it is not read
        return Placement(devices[0], mesh)
    plan = model_plan(model)
    if not getattr(model, "_tp_plan", None):
        raise KernelInputError(
            f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan); "
            "model-bench shards only models that declare one"
        )
    return Placement(devices[0], mesh, plan)
