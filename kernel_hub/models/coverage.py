"""``kernel-hub models``: kernelize a tiny model of every architecture and compare with stock.

Per architecture (see ``architectures``): the stock model's main output on a padded batch (and,
in training mode, the gradient of a fixed random projection of it), then the same after
``kernelize``. The result says what was swapped, what was left alone and why, the largest
|difference| on real (non-padding) positions, and in training mode the largest relative
difference of each gradient to the exact one (the stock model run in f64), over parameters
whose exact gradient is not zero.

An architecture with swaps passes only within ``TOLERANCE`` on both; a difference beyond it is a
``mismatch`` and an exception after kernelize reported swaps is ``broken``: both are defects of
kernel-hub, never of the model.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UnknownNameError
from ..layers.kernelize import kernelize, unkernelize
from ..layers.modes import Mode
from . import architectures as archs

TOLERANCE = 1e-4
"""Largest |output difference| (f32) and relative gradient difference called a match."""

STOCK_ERROR_FACTOR = 2.0
"""A kernelized gradient may be off from the f64 truth by twice the f32 error the problem allows
where that exceeds ``TOLERANCE``: two f32 computations that sum in different orders differ by
about the conditioning of the problem (xlm-roberta-xl's key weight: stock f32 5.6e-4, the kernel
7.9e-4), while a real defect (a dropped mask, a missing gradient) is off by orders of magnitude."""

ROUNDING_SAMPLES = 3
"""Stock f32 runs with parameters moved by one rounding each, for a gradient that fails against
stock's own error: stock's error is one sample of rounding luck (Persimmon's q-LayerNorm bias:
stock 8.2e-5 off f64, a plain torch LayerNorm re-implementation 1.6e-4), while a backward-stable
f32 computation is exact for inputs perturbed by about a rounding, so the largest error of those
runs is the error any f32 implementation may have."""

ZERO_GRADIENT = 1e-6
"""Gradients below this fraction of the model's largest are float noise around an exact zero."""

FLAGSHIPS = (
    "llama",
    "llama4",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gemma3",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "mistral",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
    "phi3",
    "olmo2",
    "falcon_h1",
    "granitemoehybrid",
    "nemotron_h",
)
"""Model types of the models people deploy now, whose depth ``summary`` reports on its own line:
Llama 3 and 4, Qwen3/3-MoE/3.5/3-Next, Gemma 3 and 4, Mistral/Mixtral, DeepSeek-V3, GPT-OSS,
GLM-4-MoE, Phi-3/4 (Phi-4's text model is the Phi-3 architecture), OLMo 2, Falcon-H1, Granite-4
hybrid (granitemoehybrid), Nemotron-H."""

EXACT, UNCHANGED, MISMATCH, BROKEN = "exact", "unchanged", "MISMATCH", "BROKEN"
NOT_BUILT, STOCK_FAILS = "not built", "stock fails"
DEFECTS = (MISMATCH, BROKEN)


@dataclass(frozen=True)
class LeftAlone:
    cls: str
    target: str
    reason: str
    count: int


@dataclass(frozen=True)
class Result:
    """One architecture in one mode."""

    model_type: str
    family: str
    model: str
    mode: str
    status: str
    swapped: dict[str, int] = field(default_factory=dict)
    left_alone: tuple[LeftAlone, ...] = ()
    max_diff: float | None = None
    grad_rel_diff: float | None = None
    """Training: largest relative gradient difference to the exact (f64) stock gradient."""
    stock_grad_rel_diff: float | None = None
    """Training: the same for the stock model's f32 gradients, its own float error."""
    grads_compared: int = 0
    detail: str | None = None
    """Why it was not built / what failed / which gradient differed most."""

    @property
    def ran(self) -> bool:
        return self.status not in (NOT_BUILT, STOCK_FAILS)

    @property
    def candidates(self) -> int:
        """Modules some kernel could serve: those swapped and those left alone with a reason."""
        return sum(self.swapped.values()) + sum(e.count for e in self.left_alone)

    @property
    def depth(self) -> float | None:
        """The fraction of the candidates swapped (None with no candidate)."""
        return sum(self.swapped.values()) / self.candidates if self.candidates else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "candidates": self.candidates, "depth": self.depth}


@dataclass(frozen=True)
class _Run:
    output: torch.Tensor
    grads: dict[str, torch.Tensor | None]


def _projection(output: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(99)
    return torch.randn(output.shape, generator=generator)


def _run(model: torch.nn.Module, inputs: dict[str, torch.Tensor], training: bool) -> _Run:
    if not training:
        with torch.no_grad():
            return _Run(archs.main_output(model(**inputs)).float(), {})
    model.zero_grad(set_to_none=True)
    output = archs.main_output(model(**inputs)).float()
    real = archs.real_positions(inputs, output)
    weights = _projection(output)
    if real is not None:
        weights = weights * real.reshape(*real.shape, *([1] * (output.dim() - 2)))
    (output * weights).sum().backward()
    grads = {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return _Run(output.detach(), grads)


def _max_diff(inputs: dict[str, torch.Tensor], stock: torch.Tensor, other: torch.Tensor) -> float:
    if stock.shape != other.shape:
        return math.inf
    real = archs.real_positions(inputs, stock)
    diff = (other - stock).abs()
    diff = diff[real] if real is not None else diff
    return diff.max().item() if diff.numel() else 0.0


def _largest(grad: torch.Tensor | None) -> float:
    return 0.0 if grad is None else grad.abs().max().item()


def _relative(grad: torch.Tensor | None, exact: torch.Tensor) -> float:
    if grad is None:
        return math.inf
    return ((grad.double() - exact.double()).abs().max() / exact.abs().max()).item()


@dataclass(frozen=True)
class _GradientCheck:
    worst: float
    """Largest relative difference of a kernelized gradient to the exact one."""
    stock_worst: float
    """The same for the stock model's own f32 gradients (its float error)."""
    compared: int
    failing: tuple[str, ...]
    """Parameters whose kernelized gradient is off by more than the tolerance allows."""


def _check_gradients(
    exact: dict[str, torch.Tensor | None],
    stock: dict[str, torch.Tensor | None],
    kernelized: dict[str, torch.Tensor | None],
    rounding: dict[str, float] | None = None,
) -> _GradientCheck:
    """Kernelized f32 gradients against exact (f64) ones, parameter by parameter.

    One passes within ``TOLERANCE`` relative, or within ``STOCK_ERROR_FACTOR`` times the f32 error
    the problem allows where that is larger (near-uniform softmaxes in random tiny models make
    q/k gradients a difference of near-equal numbers): the stock f32 model's own error, or the
    largest error of stock runs perturbed by a rounding where ``rounding`` measured it. A
    parameter whose exact gradient is zero (a key bias under softmax) gets float noise from stock
    and kernel alike: below ``ZERO_GRADIENT`` of the model's largest exact gradient there is
    nothing to agree on; nor where the stock f32 gradient is not finite (Gemma 3n's embedding).
    """
    rounding = rounding or {}
    floor = ZERO_GRADIENT * max((_largest(g) for g in exact.values()), default=0.0)
    worst = stock_worst = 0.0
    compared, failing = 0, []
    for name, truth in exact.items():
        if truth is None or _largest(truth) <= floor:
            continue
        if stock[name] is not None and not bool(stock[name].isfinite().all()):
            continue  # the stock model's own gradient is not a number: nothing to agree on
        compared += 1
        error, stock_error = _relative(kernelized.get(name), truth), _relative(stock[name], truth)
        worst, stock_worst = max(worst, error), max(stock_worst, stock_error)
        allowed = STOCK_ERROR_FACTOR * max(stock_error, rounding.get(name, 0.0))
        if not error <= max(TOLERANCE, allowed):  # NaN fails too
            failing.append(name)
    return _GradientCheck(worst, stock_worst, compared, tuple(failing))


def _rounding_errors(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor | None],
    names: Sequence[str],
) -> dict[str, float]:
    """The largest relative error of ``names``' stock f32 gradients over ``ROUNDING_SAMPLES``
    runs with every parameter moved by one f32 epsilon (random sign), parameters restored after."""
    generator = torch.Generator().manual_seed(7)
    kept = [(p, p.detach().clone()) for p in model.parameters() if p.is_floating_point()]
    errors = dict.fromkeys(names, 0.0)
    try:
        for _ in range(ROUNDING_SAMPLES):
            with torch.no_grad():
                for p, value in kept:
                    sign = torch.randint(0, 2, value.shape, generator=generator) * 2 - 1
                    eps = torch.finfo(value.dtype).eps
                    p.copy_((value.double() * (1 + eps * sign)).to(value.dtype))
            grads = _run(model, inputs, training=True).grads
            for name in names:
                errors[name] = max(errors[name], _relative(grads[name], exact[name]))
    finally:
        with torch.no_grad():
            for p, value in kept:
                p.copy_(value)
    return errors


def _exact_gradients(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], stock: _Run
) -> dict[str, torch.Tensor | None]:
    """The stock model's gradients in f64, the reference both f32 runs are judged against
    (the stock f32 ones where the model does not run in f64, or its f64 gradients are not
    finite where the f32 ones are: eager attention's fully masked padding rows add two f64
    minima to -inf, a NaN softmax whose zero weight in the loss still gives NaN gradients)."""
    try:
        reference = copy.deepcopy(model).double()
        wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        exact = _run(reference, wide, training=True).grads
    except Exception:  # an op without f64 support: stock f32 is the best reference there is
        return stock.grads
    finite = all(
        bool(g.isfinite().all()) or not bool(stock.grads[n].isfinite().all())
        for n, g in exact.items()
        if g is not None and stock.grads.get(n) is not None
    )
    return exact if finite else stock.grads


def _left_alone(report: Any) -> tuple[LeftAlone, ...]:
    counts = Counter((e.cls, e.target, e.reason) for e in report.left_alone)
    return tuple(LeftAlone(c, t, r, n) for (c, t, r), n in counts.items())


def check_architecture(
    arch: archs.Architecture, mode: Mode, registry: str | Path | None = None
) -> Result:
    """Build, run stock, kernelize, run again, compare; never raises for a model's sake."""
    base = {
        "model_type": arch.model_type,
        "family": arch.family,
        "model": arch.class_name,
        "mode": mode.label,
    }
    training = Mode.TRAINING in mode
    failure = not_built = None
    for variant in archs.CONFIG_VARIANTS:
        try:
            model = archs.build(arch, variant)
        except archs.NotBuilt as exc:  # a config rule the next variant may satisfy (Dots 3)
            not_built = not_built or str(exc)
            continue
        model.train(training)
        try:
            inputs = archs.batch(arch, model)
            stock = _run(model, inputs, training)
            break
        except Exception as exc:  # the architecture does not run on this tiny config
            failure = failure or archs.one_line(exc)
    else:
        if failure is None:
            return Result(**base, status=NOT_BUILT, detail=not_built)
        return Result(**base, status=STOCK_FAILS, detail=failure)
    exact = _exact_gradients(model, inputs, stock) if training else {}
    try:
        report = kernelize(model, mode=mode, registry=registry)
    except Exception as exc:
        return Result(**base, status=BROKEN, detail=f"kernelize raised {archs.one_line(exc)}")
    found = {"swapped": report.counts(), "left_alone": _left_alone(report)}
    try:
        kernelized = _run(model, inputs, training)
        unkernelize(model)
    except Exception as exc:
        return Result(**base, **found, status=BROKEN, detail=archs.one_line(exc))
    diff = _max_diff(inputs, stock.output, kernelized.output)
    grads = _check_gradients(exact, stock.grads, kernelized.grads)
    if grads.failing:  # one stock run's rounding luck is no measure of the problem's: ask more
        rounding = _rounding_errors(model, inputs, exact, grads.failing)
        grads = _check_gradients(exact, stock.grads, kernelized.grads, rounding)
    agrees = diff <= TOLERANCE and not grads.failing
    status = (EXACT if report.swapped else UNCHANGED) if agrees else MISMATCH
    return Result(
        **base,
        **found,
        status=status,
        max_diff=diff,
        grad_rel_diff=grads.worst if training else None,
        stock_grad_rel_diff=grads.stock_worst if training else None,
        grads_compared=grads.compared,
        detail=f"gradient of {grads.failing[0]} differs beyond tolerance"
        if grads.failing
        else None,
    )


@contextmanager
def _quiet(threads: int | None) -> Iterator[None]:
    """Transformers' and torch's warnings off, torch threads pinned, for the run's duration."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    previous_threads = torch.get_num_threads()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        logging.disable(logging.NOTSET)
        torch.set_num_threads(previous_threads)


def run_coverage(
    mode: Mode | str = Mode.INFERENCE,
    *,
    families: Sequence[str] = tuple(archs.FAMILIES),
    model_types: Sequence[str] | None = None,
    registry: str | Path | None = None,
    threads: int | None = 1,
    progress: Callable[[Result, int, int], None] | None = None,
) -> list[Result]:
    """One ``Result`` per architecture of ``families`` (only ``model_types`` if given);
    ``progress(result, done, total)`` after each."""
    mode = Mode.parse(mode)
    for family in families:
        if family not in archs.FAMILIES:
            raise UnknownNameError("family", family, archs.FAMILIES)
    found = archs.architectures(tuple(families))
    if model_types is not None:
        known = {a.model_type for a in found}
        missing = sorted(set(model_types) - known)
        if missing:
            raise UnknownNameError("architecture", missing[0], sorted(known))
        found = [a for a in found if a.model_type in set(model_types)]
    results = []
    with _quiet(threads):
        for arch in found:
            result = check_architecture(arch, mode, registry)
            results.append(result)
            if progress is not None:
                progress(result, len(results), len(found))
    return results


def flagship_summary(results: Sequence[Result]) -> str | None:
    """The depth over the ``FLAGSHIPS`` that ran, in one line (None when none ran)."""
    ran = [r for r in results if r.ran and r.model_type in FLAGSHIPS]
    candidates = sum(r.candidates for r in ran)
    if not candidates:
        return None
    swapped = sum(sum(r.swapped.values()) for r in ran)
    return (
        f"flagships ({len(ran)} of {len(FLAGSHIPS)} run): {swapped} of {candidates} candidate "
        f"modules swapped, {100 * swapped / candidates:.0f}% depth"
    )


def summary(results: Sequence[Result]) -> str:
    """``swapped / left alone / architectures`` and the defect counts, in one line."""
    ran = [r for r in results if r.ran]
    statuses = Counter(r.status for r in results)
    swapped = sum(sum(r.swapped.values()) for r in ran)
    left = sum(e.count for r in ran for e in r.left_alone)
    mode = results[0].mode if results else "-"
    return (
        f"{mode}: {len(ran)} architectures run ({statuses[EXACT]} with swaps within "
        f"{TOLERANCE:g}, {statuses[UNCHANGED]} unchanged); modules: {swapped} swapped, {left} "
        f"left alone; {statuses[MISMATCH]} mismatches, {statuses[BROKEN]} broken; "
        f"{statuses[NOT_BUILT]} not built, {statuses[STOCK_FAILS]} fail stock"
    )
