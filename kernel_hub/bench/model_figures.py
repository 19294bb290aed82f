"""Whole-model figures of a compiled TPU program: peak HBM, bytes, FLOPs, roofline, full depth.

``kernel-hub model-bench`` compiles a model's step with a few decoder layers: a base of N - 1
layers of each layer type the model has (sliding or full attention, linear attention, ...), and
for each type the base plus one layer of that type; layers of one type are identical, so each
difference is one layer's cost of that type and the full model is ``base + sum over types of
(count - (N - 1)) * (figures(base + one) - base)`` (``scale_by_type``; with one type, ``figures(N)
+ (L - N) * (figures(N) - figures(N - 1))``). Temporaries are a peak of live buffers, not a sum:
they scale so only in a training step, whose every layer keeps its activations for the backward;
a forward-only step frees a layer's activations once the next layer has read them, so its
temporaries are the largest compiled program's (a difference between two of them is the compiler's
placement, not a layer's cost: Flux's kernelized v5e step holds 480, 601 and 557 MB with 1, 2 and 3
single-stream blocks). Everything here is what the deviceless compiler reports
(``memory_analysis``, ``cost_analysis``), plus the timing of a compiled program when a TPU is
present (``median_ms``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kernel_hub.errors import KernelInputError

from .roofline import TPU_CHIPS
from .timing import percentile

PALLAS_CALL_NAME = re.compile(r"pallas_call\[.*?\bname=(\w+)", re.S)
_WHILE_LOOP = re.compile(r"\bwhile\(")


@dataclass(frozen=True)
class ProgramFigures:
    """What the compiler says about one compiled program (bytes and FLOPs per step)."""

    argument_bytes: float
    output_bytes: float
    temp_bytes: float
    alias_bytes: float
    bytes_accessed: float
    flops: float
    min_bytes_correction: float = 0.0
    """What the hand count of least traffic adds to arguments + outputs - aliased outputs (a
    decode step: the new tokens' K/V written, less a cache buffer's unused room)."""

    @property
    def peak_hbm_bytes(self) -> float:
        """Arguments + temporaries + outputs (an output reusing an argument buffer counted once)."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def min_bytes(self) -> float:
        """Hand count of the least traffic: every argument read once, every output written once
        (weights, tokens, gradients or logits; an output updating an argument in place once),
        plus ``min_bytes_correction``; activations moved in between are not counted, so it is a
        lower bound."""
        return (
            self.argument_bytes + self.output_bytes - self.alias_bytes + self.min_bytes_correction
        )

    def __sub__(self, other: ProgramFigures) -> ProgramFigures:
        return ProgramFigures(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    def plus(self, other: ProgramFigures, times: float) -> ProgramFigures:
        """``self + times * other``, field by field."""
        return ProgramFigures(
            **{f.name: getattr(self, f.name) + times * getattr(other, f.name) for f in fields(self)}
        )


def program_figures(compiled: Any, *, min_bytes_correction: float = 0.0) -> ProgramFigures:
    """Figures of a ``jax.stages.Compiled`` (deviceless or on a TPU)."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return ProgramFigures(
        argument_bytes=float(memory.argument_size_in_bytes),
        output_bytes=float(memory.output_size_in_bytes),
        temp_bytes=float(memory.temp_size_in_bytes),
        alias_bytes=float(memory.alias_size_in_bytes),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        flops=float(cost.get("flops", 0.0)),
        min_bytes_correction=min_bytes_correction,
    )


def scale_by_type(
    base: ProgramFigures,
    one_more: Mapping[str, ProgramFigures],
    per_type_in_base: int,
    counts: Mapping[str, int],
    *,
    layers_keep_activations: bool,
) -> ProgramFigures:
    """The full model from a base program holding ``per_type_in_base`` layers of each type and,
    per type, the base plus one layer of it (``one_more``); ``counts``: the full model's layers
    per type. Temporaries scale with depth only when ``layers_keep_activations`` (a training
    step); otherwise they are the largest compiled program's (the module docstring says why)."""
    if set(one_more) != set(counts):
        raise KernelInputError(
            f"layer types compiled ({', '.join(sorted(one_more))}) are not the model's "
            f"({', '.join(sorted(counts))})"
        )
    full = base
    for kind, program in one_more.items():
        if counts[kind] < per_type_in_base + 1:
            raise KernelInputError(
                f"{counts[kind]} {kind} layers: scaling compiles {per_type_in_base + 1} of them"
            )
        full = full.plus(program - base, counts[kind] - per_type_in_base)
    if layers_keep_activations:
        return full
    peak = max(program.temp_bytes for program in (base, *one_more.values()))
    return replace(full, temp_bytes=peak)


def pallas_kernels(jaxpr_text: str) -> list[str]:
    """Names of the Pallas kernels a traced program calls, sorted, each once."""
    return sorted(set(PALLAS_CALL_NAME.findall(jaxpr_text)))


def has_loops(hlo_text: str) -> bool:
    """Whether a compiled program runs a while loop (whose body XLA's cost model counts once)."""
    return bool(_WHILE_LOOP.search(hlo_text))


def roofline_ms(tpu: str, flops: float, bytes_accessed: float) -> float:
    """The generation's floor for this much work, in milliseconds."""
    return 1e3 * TPU_CHIPS[tpu].time_floor(flops, bytes_accessed)


def median_ms(
    run: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 10,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median wall time of ``run`` (which must wait for its results) after ``warmup`` calls."""
    if warmup < 0 or repeats < 1:
        raise KernelInputError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = clock()
        run()
        samples.append(clock() - start)
    return 1e3 * percentile(samples, 50)


@dataclass(frozen=True)
class VariantResult:
    """One row of the model bench: a model, mode and TPU, stock or kernelized, at full depth."""

    model: str
    mode: str
    tpu: str
    variant: str
    """``stock`` or ``kernelized``."""
    peak_hbm_bytes: float | None
    """None (like every figure) when the step does not fit one chip's HBM (``hbm_overflow``)."""
    bytes_accessed: float | None
    flops: float | None
    roofline_ms: float | None
    kernels: list[str]
    """Pallas kernels (by name) in the compiled program."""
    replaced: dict[str, str]
    """Stock slot or layer -> the kernel-hub op that replaced it and how many modules."""
    min_bytes: float | None
    """Hand count (``ProgramFigures.min_bytes``) at full depth."""
    compiled_layers: int
    full_layers: int
    measured_ms: float | None
    """Median on a real TPU of this generation; None when none is present."""
    notes: list[str] = field(default_factory=list)
    compiled: dict[str, float] = field(default_factory=dict)
    """The largest program compiled (``compiled_layers`` layers), unscaled."""
    chips: int = 1
    """Chips the step is sharded over; the figures are one chip's."""
    hbm_overflow: str | None = None
    """libtpu's figure (needed > available) when it refused the step for lack of one chip's HBM:
    a row without figures, kept so the other variant is reported beside it."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def variant_result(
    *,
    model: str,
    mode: str,
    tpu: str,
    variant: str,
    base: ProgramFigures,
    one_more: Mapping[str, ProgramFigures],
    per_type_in_base: int,
    counts: Mapping[str, int],
    kernels: list[str],
    replaced: dict[str, str],
    loops: bool,
    layers_keep_activations: bool,
    measured_ms: float | None = None,
    notes: tuple[str, ...] = (),
    chips: int = 1,
) -> VariantResult:
    """A row at full depth, with the notes that say which figures to distrust and why; the
    programs as ``scale_by_type`` takes them. ``compiled`` keeps the last program of
    ``one_more`` unscaled."""
    full = scale_by_type(
        base,
        one_more,
        per_type_in_base,
        counts,
        layers_keep_activations=layers_keep_activations,
    )
    full_layers = sum(counts.values())
    compiled_layers = per_type_in_base * len(counts) + 1
    if len(counts) == 1:
        scaling = (
            f"scaled from {compiled_layers} compiled decoder layers to {full_layers}: "
            f"figures({compiled_layers}) + {full_layers - compiled_layers} x one layer's "
            f"(figures({compiled_layers}) - figures({compiled_layers - 1}))"
        )
    else:
        scaling = (
            f"scaled by layer type to {full_layers} layers "
            f"({', '.join(f'{n} {kind}' for kind, n in counts.items())}): a base of "
            f"{per_type_in_base} layer(s) of each type, plus per type (its count - "
            f"{per_type_in_base}) x one layer's (figures(base + one of it) - figures(base))"
        )
    temporaries = (
        "temporaries scaled with depth like the rest (each layer keeps its activations for the "
        "backward)"
        if layers_keep_activations
        else "temporaries not scaled: the largest compiled program's (a forward-only step holds "
        "one layer's activations at a time)"
    )
    notes = [
        scaling,
        temporaries,
        "libtpu's deviceless compiler model, not a run on a chip",
        *notes,
    ]
    if kernels:
        notes.append(
            "bytes and FLOPs of the Pallas kernels are only their declared CostEstimate "
            f"({', '.join(kernels)}); min_bytes is a hand count beside it"
        )
    if loops:
        notes.append("the program has while loops: XLA counts a loop body once (undercount)")
    deep = list(one_more.values())[-1]
    return VariantResult(
        model=model,
        mode=mode,
        tpu=tpu,
        variant=variant,
        peak_hbm_bytes=full.peak_hbm_bytes,
        bytes_accessed=full.bytes_accessed,
        flops=full.flops,
        roofline_ms=roofline_ms(tpu, full.flops, full.bytes_accessed),
        kernels=kernels,
        replaced=replaced,
        min_bytes=full.min_bytes,
        compiled_layers=compiled_layers,
        full_layers=full_layers,
        measured_ms=measured_ms,
        notes=notes,
        compiled={**asdict(deep), "peak_hbm_bytes": deep.peak_hbm_bytes},
        chips=chips,
    )


def overflow_result(
    *,
    model: str,
    mode: str,
    tpu: str,
    variant: str,
    hbm_overflow: str,
    compiled_layers: int,
    full_layers: int,
    message: str,
    chips: int = 1,
) -> VariantResult:
    """A row for a variant libtpu refused to compile (``compiled_layers``: the refused program's
    layers): no figures, the refusal in its notes."""
    return VariantResult(
        model=model,
        mode=mode,
        tpu=tpu,
        variant=variant,
        peak_hbm_bytes=None,
        bytes_accessed=None,
        flops=None,
        roofline_ms=None,
        kernels=[],
        replaced={},
        min_bytes=None,
        compiled_layers=compiled_layers,
        full_layers=full_layers,
        measured_ms=None,
        notes=[message],
        chips=chips,
        hbm_overflow=hbm_overflow,
    )


MODEL_BENCH_HEADERS = (
    "model",
    "mode",
    "tpu",
    "variant",
    "peak HBM GiB",
    "GB accessed",
    "TFLOP",
    "roofline ms",
    "min GB (hand)",
    "measured ms",
    "kernels",
)


def model_bench_row(result: VariantResult) -> list[str]:
    cell = [
        result.model,
        result.mode,
        result.tpu if result.chips == 1 else f"{result.tpu} x{result.chips} (per chip)",
        result.variant,
    ]
    if result.hbm_overflow is not None:
        blank = ["-"] * (len(MODEL_BENCH_HEADERS) - len(cell) - 1)
        return [*cell, f"does not fit one chip's HBM: {result.hbm_overflow}", *blank]
    measured = "-" if result.measured_ms is None else f"{result.measured_ms:.4g}"
    return [
        *cell,
        f"{result.peak_hbm_bytes / 2**30:.4g}",
        f"{result.bytes_accessed / 1e9:.4g}",
        f"{result.flops / 1e12:.4g}",
        f"{result.roofline_ms:.4g}",
        f"{result.min_bytes / 1e9:.4g}",
        measured,
        ", ".join(result.kernels) or "-",
    ]
