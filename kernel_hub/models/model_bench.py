"""What kernelize buys a whole model on a TPU: the same model compiled stock and kernelized.

The model is built at real width on the meta device (no weights), with a few decoder layers: N - 1
of each layer type the model has (sliding or full attention, linear attention: Transformers'
``layer_types``), and that base plus one layer of each type in turn.
torchax turns it into one JAX function of its parameters, the way torchax runs a torch model on a
TPU (``torch.func.functional_call`` over "jax" tensors); the function is traced with
``ShapeDtypeStruct`` arguments on a deviceless TPU of the chosen generation, so the kernels'
implementation tables pick their Pallas TPU implementations, and compiled by libtpu. The figures
of the compiles are scaled to the full depth per layer type (``kernel_hub.bench.model_figures``).
A spec with a ``topology`` compiles one SPMD program for every chip of a multi-chip grid, the model
sharded by its tensor-parallel plan and FSDP (``bench_sharding``); a Diffusers transformer's step
is one denoising step (``diffusion_bench``), its block types the layer types.

Importing torchax renames torch's PrivateUse1 device for the rest of the process (torch.compile
breaks there): run this in a process of its own, as the ``kernel-hub model-bench`` command does.

Kernelize refuses modules whose weights are on the meta device (they are not loaded), so the
kernelized model gets zero-filled "jax" tensors while kernelize probes it, and meta tensors again
before tracing: the traced program reads every parameter from its arguments.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel_hub.bench.compile_check import no_persistent_cache
from kernel_hub.bench.figure_cache import compile_figures
from kernel_hub.bench.model_figures import (
    ProgramFigures,
    VariantResult,
    median_ms,
    overflow_result,
    pallas_kernels,
    variant_result,
)
from kernel_hub.bench.overflow import MemoryOverflow, memory_overflow
from kernel_hub.bench.roofline import TPU_CHIPS
from kernel_hub.errors import KernelInputError, UnknownNameError
from kernel_hub.topologies import TOPOLOGIES, filtered_libtpu_stderr

from .bench_sharding import Placement, placement, topology_chips
from .decode_bench import CACHES, KV_CACHE_DTYPES, DecodeShape, decode_step
from .diffusion_bench import TEXT_TOKENS, image_tokens
from .diffusion_bench import build as build_diffusion_model
from .diffusion_bench import layer_types as diffusion_layer_types
from .diffusion_bench import step as diffusion_step
from .presets import preset
from .quantized_bench import WEIGHTS, hold_quantized, weights_note

MODES = ("train", "prefill", "decode", "denoise")
"""``denoise``: one denoising step of a Diffusers transformer (``diffusion_bench``); the others
are a Transformers causal LM's."""
LIBRARIES = ("transformers", "diffusers")
VARIANTS = ("stock", "kernelized")
UNNAMED_TYPE = "decoder"
"""The layer type of a model whose config names none (all its decoder layers alike)."""
STOCK_EXPERTS = "batched_mm"
FULL_TYPE = "full_attention"
LINEAR_TYPE = "linear_attention"
"""Transformers' layer type of a linear-attention (recurrent) decoder layer (Qwen3-Next's gated
delta rule)."""


class HbmOverflowError(KernelInputError):
    """libtpu refused a variant's step: it does not fit one chip's HBM."""

    def __init__(self, message: str, overflow: MemoryOverflow, layers: int) -> None:
        super().__init__(message)
        self.overflow = overflow
        self.layers = layers
        """Decoder layers of the refused program."""


@dataclass(frozen=True)
class BenchSpec:
    """One model-bench cell: a model, a mode and its shapes, a TPU generation."""

    name: str
    model_type: str
    config: Mapping[str, Any]
    mode: str
    tpu: str
    batch: int = 1
    seq: int = 4096
    layers: int = 2
    overrides: Mapping[str, Any] = field(default_factory=dict)
    context: int = 4096
    """decode: tokens per sequence in the KV cache after the step (the new one included)."""
    cache: str = "paged"
    """decode: ``static`` (Transformers' StaticCache) or ``paged`` (continuous batching)."""
    topology: str | None = None
    """A multi-chip grid of the generation (``2x2``, ``4x4``): the step sharded over it
    (``bench_sharding``); None: one chip."""
    tp: int | None = None
    """Chips on the mesh's tensor-parallel axis (default: all); the rest are FSDP."""
    library: str = "transformers"
    """Where ``model_type`` comes from: a Transformers model type, or a Diffusers model class."""
    image: int = 1024
    """denoise: the image's side in pixels."""
    weights: str = "bf16"
    """decode: the kernelized variant's linear weights, bf16 or held quantized
    (``quantized_bench``); the stock variant holds them dequantized (bf16)."""
    kv_cache_dtype: str = "bfloat16"
    """decode: the kernelized variant's cache dtype (8-bit: models whose layers are all full
    attention); the stock variant's cache stays bf16."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UnknownNameError("model-bench mode", self.mode, MODES)
        if self.cache not in CACHES:
            raise UnknownNameError("decode cache", self.cache, CACHES)
        if self.weights not in WEIGHTS:
            raise UnknownNameError("model-bench weights", self.weights, WEIGHTS)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UnknownNameError("KV cache dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self._check_quantization()
        if self.tpu not in TOPOLOGIES or self.tpu not in TPU_CHIPS:
            raise UnknownNameError("TPU generation", self.tpu, set(TOPOLOGIES) & set(TPU_CHIPS))
        if self.library not in LIBRARIES:
            raise UnknownNameError("model library", self.library, LIBRARIES)
        if (self.mode == "denoise") != (self.library == "diffusers"):
            raise KernelInputError(
                f"--mode {self.mode} is not one for {self.name} ({self.library}): a Diffusers "
                "transformer runs --mode denoise, a causal LM train, prefill or decode"
            )
        if self.mode == "denoise":
            image_tokens(self.image)
            if self.topology is not None:
                raise KernelInputError(
                    "--topology with --mode denoise: not built (Flux's TP plan packs its "
                    "single-stream output projection, which model-bench does not shard)"
                )
        if self.topology is not None:
            chips = topology_chips(self.topology)
            if self.mode == "decode" and self.cache == "paged":
                raise KernelInputError(
                    "--cache paged on a --topology: not built (stock continuous batching keeps one "
                    "flat buffer with no head axis to shard); use --cache static"
                )
            if self.tp is not None and (self.tp < 1 or chips % self.tp):
                raise KernelInputError(
                    f"--tp {self.tp} must divide the {chips} chips of {self.topology}"
                )
        elif self.tp not in (None, 1):
            raise KernelInputError(f"--tp {self.tp} needs a multi-chip --topology")
        for name in ("batch", "seq", "context"):
            if getattr(self, name) < 1:
                raise KernelInputError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.layers < 2:
            raise KernelInputError(
                f"--layers must be >= 2 (one layer's cost is the difference of {self.layers} "
                f"and {self.layers - 1} compiled layers), got {self.layers}"
            )
        if self.layers > self.full_layers:
            raise KernelInputError(
                f"--layers {self.layers} is more than the model's {self.full_layers} layers"
            )

    def _check_quantization(self) -> None:
        """Quantized weights and an 8-bit cache are built for a one-chip decode step."""
        asked = [
            f"--{name} {value}"
            for name, value, default in (
                ("weights", self.weights, "bf16"),
                ("kv-cache-dtype", self.kv_cache_dtype, "bfloat16"),
            )
            if value != default
        ]
        if not asked:
            return
        if self.mode != "decode":
            raise KernelInputError(
                f"{' '.join(asked)} with --mode {self.mode}: not built (model-bench holds "
                "quantized weights and an 8-bit KV cache in --mode decode only)"
            )
        if self.topology is not None:
            raise KernelInputError(
                f"{' '.join(asked)} on a --topology: not built (the sharding plan splits bf16 "
                "weights; a quantized weight's packing and block scales are not placed); "
                "compile it on one chip"
            )

    def stock(self) -> BenchSpec:
        """The stock variant's cell: dequantized (bf16) weights and a bf16 cache."""
        return dataclasses.replace(self, weights="bf16", kv_cache_dtype="bfloat16")

    def layer_types(self) -> list[str]:
        """The full model's layer type per decoder layer (``decoder`` for a model that names
        none)."""
        if self.library == "diffusers":
            return diffusion_layer_types(self.fields())
        kinds = self.fields().get("layer_types")
        if kinds is None:
            kinds = getattr(_config(self, None), "layer_types", None)
        return list(kinds) if kinds is not None else [UNNAMED_TYPE] * self.full_layers

    def plan(self) -> tuple[list[str], dict[str, list[str]]]:
        """The layer types of the base program (N - 1 of each type, in order of first use) and,
        per type, of the base plus one of it."""
        kinds = self.layer_types()
        others = sorted(set(kinds) - {FULL_TYPE, UNNAMED_TYPE})
        if self.kv_cache_dtype != "bfloat16" and others:
            raise KernelInputError(
                f"--kv-cache-dtype {self.kv_cache_dtype} for {self.name}: kernel-hub's 8-bit "
                f"serving caches hold full-attention layers only; this model has "
                f"{', '.join(others)} layers"
            )
        order = list(dict.fromkeys(kinds))
        base = order * (self.layers - 1)
        for kind in order:
            if kinds.count(kind) < self.layers:
                raise KernelInputError(
                    f"--layers {self.layers}: the model has {kinds.count(kind)} {kind} layers; "
                    f"scaling compiles up to {self.layers} of each type"
                )
        return base, {kind: [*base, kind] for kind in order}

    @property
    def full_layers(self) -> int:
        if self.library == "diffusers":
            return len(self.layer_types())
        return int(self.fields()["num_hidden_layers"])

    def fields(self) -> dict[str, Any]:
        return {**self.config, **self.overrides}


def spec_for_preset(name: str, **kwargs: Any) -> BenchSpec:
    chosen = preset(name)
    return BenchSpec(name, chosen.model_type, chosen.config, library=chosen.library, **kwargs)


def spec_for_config_file(path: str | Path, **kwargs: Any) -> BenchSpec:
    """A Transformers ``config.json`` (its ``model_type`` names the architecture)."""
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KernelInputError(f"cannot read the config {path}: {exc}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise KernelInputError(f"{path} is not a Transformers config.json (no 'model_type')")
    return BenchSpec(Path(path).stem, fields.pop("model_type"), fields, **kwargs)


def spec_for_model_type(model_type: str, **kwargs: Any) -> BenchSpec:
    """Transformers' default config for ``model_type`` (with ``overrides`` on top)."""
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except ValueError as exc:
        raise KernelInputError(f"unknown Transformers model type {model_type!r}: {exc}") from None
    defaults.pop("model_type", None)
    # derived from the default depth (a sliding-window pattern): derived again for the depth
    # the overrides set
    defaults.pop("layer_types", None)
    return BenchSpec(model_type, model_type, defaults, **kwargs)


def _config(spec: BenchSpec, kinds: list[str] | None) -> Any:
    """The model's config with decoder layers of types ``kinds`` (None: the full model)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    fields = dict(spec.fields())
    if kinds is not None:
        fields["num_hidden_layers"] = len(kinds)
        if UNNAMED_TYPE not in kinds:
            fields["layer_types"] = list(kinds)
    try:
        return AutoConfig.for_model(spec.model_type, **fields)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        raise KernelInputError(
            f"Transformers cannot build a {spec.model_type!r} config: {exc}"
        ) from None


def _build(spec: BenchSpec, kinds: list[str]) -> Any:
    """The model on the meta device with decoder layers of types ``kinds``."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.library == "diffusers":
        return build_diffusion_model(spec.model_type, spec.fields(), kinds)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(spec, kinds), dtype=torch.bfloat16)
    if model._can_set_experts_implementation():
        # Transformers' default MoE experts, grouped_mm, is aten::_grouped_mm, which torchax
        # cannot lower: the stock TPU program runs batched_mm (kernelize replaces either)
        model.set_experts_implementation(STOCK_EXPERTS)
    model.train(spec.mode == "train")
    return model


def _replace_tensors(model: Any, make: Callable[[Any], Any]) -> None:
    """Every parameter and buffer of ``model`` replaced by ``make(tensor)`` (same shape, dtype);
    a tensor shared by several modules (tied embeddings) gets one replacement, still shared."""
    import torch

    made: dict[int, Any] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(
                        make(param), requires_grad=param.requires_grad
                    )
                module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = made.setdefault(id(buffer), make(buffer))


def _kernelize(model: Any, mode: str) -> dict[str, str]:
    """kernelize on the "jax" device; returns stock slot -> what replaced it, from its report."""
    import jax
    import numpy as np
    import torch
    import torchax
    from torchax.ops.mappings import t2j_dtype

    from kernel_hub.layers.kernelize import kernelize

    env = torchax.default_env()
    host = jax.devices("cpu")[0]

    def zeros(tensor: Any) -> Any:
        # numpy's zeros are calloc'd pages the CPU client takes without a copy: nothing is
        # written unless kernelize reads the weight (torch.zeros filled every byte, a few
        # seconds a program at real width)
        array = np.zeros(tuple(tensor.shape), dtype=t2j_dtype(tensor.dtype))
        return env.j2t_iso(jax.device_put(array, host))

    _replace_tensors(model, zeros)
    report = kernelize(model, mode="training" if mode == "train" else "inference", device="jax")
    _replace_tensors(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    replaced: dict[str, tuple[str, int]] = {}
    for entry in report.swapped:
        op, count = replaced.get(entry.target, (entry.op, 0))
        replaced[entry.target] = (op, count + 1)
    return {target: f"{op} x{count}" for target, (op, count) in sorted(replaced.items())}


def _abstract(tensors: Mapping[str, Any], place: Placement, fsdp: bool) -> dict[str, Any]:
    import jax
    from torchax.ops.mappings import t2j_dtype

    return {
        name: jax.ShapeDtypeStruct(
            tuple(t.shape), t2j_dtype(t.dtype), sharding=place.weight(name, t.shape, fsdp)
        )
        for name, t in tensors.items()
    }


def _step(model: Any, spec: BenchSpec) -> Callable[..., Any]:
    """The JAX function of one step: loss and gradients (train) or last-token logits (prefill)."""
    import jax
    import torch
    import torchax

    env = torchax.default_env()

    def forward(params: Any, buffers: Any, ids: Any) -> Any:
        t_params, t_buffers, t_ids = env.j2t_iso((params, buffers, ids))
        with env:
            if spec.mode == "train":
                kwargs = {"labels": t_ids, "use_cache": False}
            else:
                kwargs = {"use_cache": False, "logits_to_keep": 1}
            out = torch.func.functional_call(model, {**t_params, **t_buffers}, (t_ids,), kwargs)
            return env.t2j_iso(out.loss if spec.mode == "train" else out.logits)

    return jax.value_and_grad(forward) if spec.mode == "train" else forward


@dataclass(frozen=True)
class CompiledStep:
    figures: ProgramFigures
    kernels: list[str]
    loops: bool
    function: Callable[..., Any]
    arguments: tuple[Any, ...]
    collectives: dict[str, int]
    """Collective ops in the compiled program (a sharded step's all-reduces, all-gathers...)."""
    chips: int
    sharding_note: str | None


@dataclass(frozen=True)
class TracedStep:
    traced: Any
    """``jax.jit(function).trace(*arguments)`` on the spec's deviceless TPU."""
    function: Callable[..., Any]
    arguments: tuple[Any, ...]
    min_bytes_correction: float
    placement: Placement


def trace_step(model: Any, spec: BenchSpec) -> TracedStep:
    """Trace ``model``'s step for the spec's TPU (one chip or the spec's mesh), deviceless (no
    compile)."""
    import jax

    place = placement(spec.tpu, spec.topology, spec.tp, model)
    device = place.device
    weights = (
        _abstract(dict(model.named_parameters()), place, fsdp=True),
        _abstract(dict(model.named_buffers()), place, fsdp=False),
    )
    correction, donated, placed = 0.0, (), {}
    if spec.mode == "train" and place.mesh is not None:
        # gradients placed like their parameters, as a sharded trainer keeps them (else the
        # partitioner may return a kernel's replicated weight gradient whole on every chip)
        params = {name: s.sharding for name, s in weights[0].items()}
        placed = {"out_shardings": (place.batch(()), params)}
    if spec.mode == "decode":
        decode = decode_step(
            model,
            DecodeShape(spec.batch, spec.context, spec.cache, spec.kv_cache_dtype),
            lambda shape, dtype, heads_dim=None: jax.ShapeDtypeStruct(
                shape, dtype, sharding=place.batch(shape, heads_dim)
            ),
        )
        function, arguments = decode.function, (*weights, decode.cache, *decode.inputs)
        correction, donated = decode.min_bytes_correction, (2,)  # the cache, updated in place
    elif spec.mode == "denoise":
        denoise = diffusion_step(
            model,
            spec.batch,
            spec.image,
            lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=place.batch(shape)),
        )
        function, arguments = denoise.function, (*weights, *denoise.inputs)
    else:
        ids = jax.ShapeDtypeStruct(
            (spec.batch, spec.seq), jax.numpy.int32, sharding=place.batch((spec.batch, spec.seq))
        )
        function, arguments = _step(model, spec), (*weights, ids)
    with (
        filtered_libtpu_stderr(),
        jax.default_device(device),
        place.kernel_mesh(spec.mode, spec.batch),
    ):
        traced = jax.jit(function, donate_argnums=donated, keep_unused=True, **placed).trace(
            *arguments
        )
    return TracedStep(traced, function, arguments, correction, place)


def compile_step(model: Any, spec: BenchSpec, figure_cache: Path | None = None) -> CompiledStep:
    """Trace ``model``'s step for the spec's TPU, deviceless, and compile it (or read its
    figures from ``figure_cache``, where this program was compiled before)."""
    import jax

    step = trace_step(model, spec)
    with filtered_libtpu_stderr(), no_persistent_cache():
        with jax.default_device(step.placement.device):
            lowered = step.traced.lower()
        target = f"{spec.tpu} topology={spec.topology} tp={spec.tp}"
        compiled = compile_figures(lowered, target, figure_cache)
    collectives = dict(compiled.collectives)
    collectives.pop("mosaic", None)
    return CompiledStep(
        dataclasses.replace(compiled.figures, min_bytes_correction=step.min_bytes_correction),
        pallas_kernels(str(step.traced.jaxpr)),
        compiled.loops,
        step.function,
        step.arguments,
        collectives,
        step.placement.chips,
        step.placement.describe(),
    )


def _measured_ms(step: CompiledStep, tpu: str) -> float | None:
    """Median time of the step on a local TPU of this generation (zero weights), else None.

    The deviceless executable cannot run on a chip: the step is compiled again for the local one
    (during the warm-up calls). A step sharded over a topology is not timed (None).
    """
    import jax

    from kernel_hub.platform import tpu_generation

    if step.chips > 1:
        return None
    local = [d for d in jax.devices() if d.platform == "tpu"]
    if not local or tpu_generation(local[0]) != tpu:
        return None
    jitted = jax.jit(step.function)
    arrays = jax.tree.map(
        lambda s: jax.numpy.zeros(s.shape, s.dtype, device=local[0]), step.arguments
    )
    return median_ms(lambda: jax.block_until_ready(jitted(*arrays)))


def bench_variant(spec: BenchSpec, variant: str, figure_cache: Path | None = None) -> VariantResult:
    """Compile one variant's programs (``BenchSpec.plan``); the row at full depth. The stock
    variant holds bf16 weights and a bf16 cache whatever ``spec`` asks (``BenchSpec.stock``).
    ``figure_cache``: the directory of ``kernel_hub.bench.figure_cache``, or None."""
    if variant not in VARIANTS:
        raise UnknownNameError("model-bench variant", variant, VARIANTS)
    cell = spec if variant == "kernelized" else spec.stock()
    base_types, plans = spec.plan()
    steps: dict[str, CompiledStep] = {}
    replaced: dict[str, str] = {}
    kept_bf16: list[tuple[str, str]] = []
    for name, kinds in {"": base_types, **plans}.items():
        model = _build(cell, kinds)
        if cell.weights != "bf16":
            kept_bf16 = hold_quantized(model, cell.weights)
        if variant == "kernelized":
            found = _kernelize(model, spec.mode)
            replaced = replaced | found
        try:
            steps[name] = compile_step(model, cell, figure_cache)
        except Exception as exc:  # libtpu's refusal is a JaxRuntimeError: read its message
            overflow = memory_overflow(str(exc))
            if overflow is None or overflow.space != "HBM":
                raise
            raise HbmOverflowError(
                f"{spec.name} {variant} --mode {spec.mode} on {spec.tpu}: the step compiled with "
                f"{len(kinds)} decoder layers does not fit a chip's HBM ({overflow.sizes(2)}), so "
                "libtpu refuses to compile it and there are no figures; shard it (--topology) or "
                "take a smaller --seq or --batch",
                overflow,
                len(kinds),
            ) from None
        del model
    base = steps.pop("")
    deep = list(steps.values())[-1]
    kinds = spec.layer_types()
    return variant_result(
        model=spec.name,
        mode=spec.mode,
        tpu=spec.tpu,
        variant=variant,
        base=base.figures,
        one_more={kind: step.figures for kind, step in steps.items()},
        per_type_in_base=spec.layers - 1,
        counts={kind: kinds.count(kind) for kind in steps},
        kernels=sorted({k for step in steps.values() for k in step.kernels}),
        replaced=replaced,
        loops=any(step.loops for step in steps.values()),
        layers_keep_activations=spec.mode == "train",
        measured_ms=_measured_ms(deep, spec.tpu),
        notes=(_shape_note(cell), *_quantization_notes(spec, cell, kept_bf16), *_mesh_notes(deep)),
        chips=deep.chips,
    )


def _mesh_notes(step: CompiledStep) -> tuple[str, ...]:
    if step.chips == 1:
        return ()
    found = ", ".join(f"{name} x{n}" for name, n in sorted(step.collectives.items()) if n)
    return (
        step.sharding_note,
        f"collectives in the largest compiled program: {found or 'none'}",
        "not timed on a chip (the timing path runs one-chip cells only)",
    )


def _quantization_notes(
    spec: BenchSpec, cell: BenchSpec, kept_bf16: list[tuple[str, str]]
) -> tuple[str, ...]:
    """What this variant holds when the cell asks for quantized weights or an 8-bit cache."""
    if spec.weights == "bf16" and spec.kv_cache_dtype == "bfloat16":
        return ()
    if cell is not spec:
        return (
            f"stock holds the dequantized (bf16) weights and a bf16 KV cache; the kernelized "
            f"row holds {spec.weights} weights and a {spec.kv_cache_dtype} cache",
        )
    notes = [weights_note(spec.weights, kept_bf16)]
    if spec.kv_cache_dtype != "bfloat16":
        notes.append(
            f"KV cache {spec.kv_cache_dtype} with one f32 scale per token and kv head "
            "(kernel-hub's serving cache, quantized on write, dequantized in the paged kernel)"
        )
    return tuple(notes)


def _shape_note(spec: BenchSpec) -> str:
    if spec.mode == "denoise":
        return (
            f"one denoising step of batch {spec.batch} at {spec.image}x{spec.image} pixels "
            f"({image_tokens(spec.image)} image tokens + {TEXT_TOKENS} text tokens), bf16 "
            "weights and activations"
        )
    if spec.mode == "decode":
        held = "bf16 weights and cache"
        if (spec.weights, spec.kv_cache_dtype) != ("bf16", "bfloat16"):
            held = f"{spec.weights} linear weights, {spec.kv_cache_dtype} cache"
        if spec.cache == "static" and LINEAR_TYPE in spec.layer_types():
            held += " (its linear-attention layers: a conv state and an f32 recurrent state)"
        return (
            f"one new token for each of {spec.batch} sequences over a {spec.cache} KV cache of "
            f"{spec.context} tokens each (the new one included), {held}; the cache is donated "
            "and returned updated"
        )
    return f"batch {spec.batch} x seq {spec.seq}, bf16 weights" + (
        ", loss and bf16 gradients (no optimizer state)"
        if spec.mode == "train"
        else ", logits of the last token only"
    )


def run_model_bench(spec: BenchSpec, figure_cache: Path | None = None) -> list[VariantResult]:
    """Both variants; a config Transformers refuses, or too few layers of a type for the
    scaling, is reported before any compile. A variant that does not fit one chip's HBM is a row
    without figures (stock often does not where kernelized does, the comparison a user wants);
    when neither fits there is nothing to compare and both refusals are the error."""
    spec.plan()
    results, refusals = [], []
    for variant in VARIANTS:
        try:
            results.append(bench_variant(spec, variant, figure_cache))
        except HbmOverflowError as exc:
            refusals.append(str(exc))
            results.append(
                overflow_result(
                    model=spec.name,
                    mode=spec.mode,
                    tpu=spec.tpu,
                    variant=variant,
                    hbm_overflow=exc.overflow.sizes(2),
                    compiled_layers=exc.layers,
                    full_layers=spec.full_layers,
                    message=str(exc),
                    chips=topology_chips(spec.topology) if spec.topology else 1,
                )
            )
    if len(refusals) == len(VARIANTS):
        raise KernelInputError("; ".join(refusals))
    return results
