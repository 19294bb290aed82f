"""Transformers' ``rotary_pos_emb`` function slot: the model's ``apply_rotary_pos_emb``, swapped
per attention module for the rotary kernel's function where a probe shows it computes the same.

The slot is a function, not a module: an attention forward calls the global
``apply_rotary_pos_emb`` of its modeling module (Transformers' ``use_kernel_forward_from_hub``
mark on it is inert without Hugging Face ``kernels``, and with it would swap the function for
every model of the module at once). kernel-hub instead gives each attention module of the
kernelized model an instance ``forward``: a copy of its class's forward (and of the decorators
wrapping it) whose globals map ``apply_rotary_pos_emb`` to the kernel's function. Other models,
the class and the modeling module are untouched, and ``unkernelize`` drops the instance forwards.
The copy's globals are the modeling module's as of kernelize (a later assignment to that
module's globals is not seen by kernelized modules until the next kernelize).

Which form a model's function computes is decided by running it on probe inputs (random cos and
sin, several heads, grouped k, both ``unsqueeze_dim`` layouts, f32, bf16 and mixed bf16/f32,
partial rotary) and comparing it bit for bit, dtype included, with each ``ROTARY_FORMS`` formula:
rotate-half or interleaved pairs, rounded in torch's promoted dtype or upcast to f32, results in
the arithmetic dtype or cast back to the inputs'. Two calling conventions are served as well:
one tensor per call (``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)``: Gemma 4; the kernel
rotates x as q with one head of x as k, whose result is dropped) and half-width cos and sin (one
value per frequency: GPT-OSS; widened in torch before the kernel), each decided by the same
probes. Anything else (a different half rotated, GLM's re-interleaved cos, mRoPE's
``apply_multimodal_rotary_pos_emb``, other signatures) is refused with the reason.

A second slot, ``apply_rotary_emb(xq, xk, freqs_cis)`` (Llama 4, DeepSeek-V2: q and k as complex
pairs times a complex ``freqs_cis``, in f32, cast back), is the interleaved-pairs form in f32 on
cos = ``freqs_cis.real`` and sin = ``freqs_cis.imag``. torch's complex product rounds its two
products and their sum in another order than the kernel's formula (1 ulp apart), so this probe
compares with the form evaluated in f64 and accepts a difference only within the rounding of
f32 arithmetic (and of the cast back); the layout (heads before or after the sequence) is the one
the function runs on. A function that fails the probe is reported, its attention left alone.

A third slot, ``apply_rotary_pos_emb_interleave(q, k, cos, sin[, position_ids], unsqueeze_dim)``
(DeepSeek-V3, GLM-4-MoE-Lite, GLM-MoE-DSA, Mistral 4, LongCat-Flash, ...: features in
interleaved pairs ``(x0, x1), (x2, x3), ...`` rotated by the first half of cos and sin, the result
laid out in halves), is the rotate-half form on q and k de-interleaved in torch
(``cat(x[..., 0::2], x[..., 1::2])``, a permutation: exact) with cos and sin's first half used
twice, decided by the same bit-for-bit probes; a forward calling both it and
``apply_rotary_pos_emb`` (DeepSeek-V3's ``rope_interleave`` switch) gets both swapped.

An attention forward that calls no slot but one other rotary function of its module which
itself calls the module's ``apply_rotary_pos_emb`` (Gemma 4's vision
``apply_multidimensional_rope``, one call per position axis) gets a copy of that function whose
slot is the kernel's: the splitting stays the stock code, each part is a slot call decided by the
probes above.

At run time the kernel's function serves the calls it takes (4-D q and k, 3-D cos and sin that
need no gradient); any other call runs the model's own function (the same result).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .recording import recording_adapter

SLOT = "apply_rotary_pos_emb"
"""The global an attention forward calls (the slot Transformers marks ``rotary_pos_emb``)."""
_OTHER_ROTARY = re.compile(r"apply_\w*(rotary|rope)\w*")
"""Other rotary functions an attention forward may call instead of the slot (vision, 2-D,
DeepSeek's de-interleaving rotary, ...): reported, not swapped."""
_SIGNATURES = {"(q, k, cos, sin, unsqueeze_dim=1)": False, "(x, cos, sin, unsqueeze_dim=1)": True}
"""The slot signatures served -> whether the function rotates one tensor per call (Gemma 4)."""
_STATE = "_kernel_hub_rotary"
COMPLEX_SLOT = "apply_rotary_emb"
"""The complex-valued rotary global (Llama 4, DeepSeek-V2): ``(xq, xk, freqs_cis)``."""
_COMPLEX_SIGNATURE = "(xq, xk, freqs_cis)"
INTERLEAVE_SLOT = "apply_rotary_pos_emb_interleave"
"""The interleaved-pairs rotary global (DeepSeek-V3 and its derivatives)."""
_INTERLEAVE_SIGNATURES = {
    "(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)": True,
    "(q, k, cos, sin, unsqueeze_dim=1)": False,
}
"""The interleaved slot signatures served -> whether it has the (unused) ``position_ids``."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Features in pairs ``(x0, x1), (x2, x3), ...`` laid out in halves: evens, then odds."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _first_half_twice(t: torch.Tensor) -> torch.Tensor:
    """cos or sin as the interleaved slot reads them (its first half, one value per pair) at the
    width the rotate-half form reads."""
    half = t[..., : t.shape[-1] // 2]
    return torch.cat((half, half), dim=-1)


@dataclass(frozen=True)
class RotaryForm:
    """A rotary formula the kernel computes exactly (``options`` are the kernel's)."""

    interleaved: bool
    upcast: bool
    cast_back: bool

    @property
    def options(self) -> dict[str, bool]:
        return {"interleaved": self.interleaved, "upcast": self.upcast, "cast_back": self.cast_back}

    def describe(self) -> str:
        rotate = "interleaved pairs" if self.interleaved else "rotate-half"
        arithmetic = "in f32" if self.upcast else "in promote(q, cos)"
        result = ", cast back to q's dtype" if self.cast_back else ""
        return f"{rotate} {arithmetic}{result}"

    def reference(self, q, k, cos, sin, unsqueeze_dim=1):
        """The formula in torch, partial rotary included (features past cos's width pass)."""
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rotate = _rotate_pairs if self.interleaved else _rotate_half
        rot = cos.shape[-1]

        def apply(x):
            part = x[..., :rot].float() if self.upcast else x[..., :rot]
            y = part * cos + rotate(part) * sin
            if self.cast_back:
                y = y.to(x.dtype)
            return torch.cat((y, x[..., rot:].to(y.dtype)), dim=-1)

        return apply(q), apply(k)


ROTARY_FORMS = tuple(
    RotaryForm(interleaved, upcast, cast_back)
    for interleaved, (upcast, cast_back) in itertools.product(
        (False, True), ((False, False), (False, True), (True, True))
    )
)


COMPLEX_FORM = RotaryForm(interleaved=True, upcast=True, cast_back=True)
"""``view_as_real(view_as_complex(x.float() pairs) * freqs_cis).type_as(x)``, the kernel's way."""


def _widen(t: torch.Tensor, form: RotaryForm) -> torch.Tensor:
    """Half-width cos or sin (one value per frequency, GPT-OSS) at the rotated width the form
    reads: both halves for rotate-half, each value twice for interleaved pairs."""
    return t.repeat_interleave(2, dim=-1) if form.interleaved else torch.cat((t, t), dim=-1)


@dataclass(frozen=True)
class RotaryCall:
    """How the model's function is called: ``single``, one tensor per call (``(x, cos, sin,
    unsqueeze_dim)``: Gemma 4) instead of q and k; ``half_width``, cos and sin with one value per
    frequency (half the rotated width: GPT-OSS), widened in torch before the kernel; ``pairs``,
    the interleaved slot (q and k de-interleaved, cos and sin's first half used twice, in torch
    before the kernel), ``position_ids`` when its signature has that parameter."""

    single: bool = False
    half_width: bool = False
    pairs: bool = False
    position_ids: bool = False

    def describe(self) -> str:
        parts = ["one tensor per call"] if self.single else []
        parts += ["half-width cos/sin"] if self.half_width else []
        parts += ["interleaved pairs de-interleaved before the kernel"] if self.pairs else []
        return ", ".join(parts)


@dataclass(frozen=True)
class RotaryRecognition:
    form: RotaryForm | None
    reason: str | None = None
    call: RotaryCall = RotaryCall()


def _probes() -> list[tuple[tuple[torch.Tensor, ...], int]]:
    """(q, k, cos, sin), unsqueeze_dim: layouts, dtypes and a partial rotary dim."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(2, 3, 5, 8), randn(2, 1, 5, 8)
    cos, sin = randn(2, 5, 8), randn(2, 5, 8)
    bf16 = torch.bfloat16
    probes = [
        ((q, k, cos, sin), 1),
        ((q.to(bf16), k.to(bf16), cos.to(bf16), sin.to(bf16)), 1),
        ((q.to(bf16), k.to(bf16), cos, sin), 1),
        ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), 2),
        ((q, k, cos[..., :4], sin[..., :4]), 1),
    ]
    return probes


def _same(out: Any, expected: tuple[torch.Tensor, torch.Tensor], single: bool) -> bool:
    if single:
        out, expected = (out,), expected[:1]
    return (
        isinstance(out, tuple)
        and len(out) == len(expected)
        and all(
            isinstance(o, torch.Tensor) and o.dtype == e.dtype and torch.equal(o, e)
            for o, e in zip(out, expected, strict=True)
        )
    )


def _plain_signature(fn: Callable[..., Any]) -> str:
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]
    return str(inspect.Signature(params))


@functools.cache
def recognise_rotary(fn: Callable[..., Any]) -> RotaryRecognition:
    """Which of ``ROTARY_FORMS`` ``fn`` computes on every probe, or why none (module docstring).

    The probes run with full-width cos and sin, then (if no form matched) with half-width ones
    (GPT-OSS's one value per frequency), against the form's formula on the widened cos and sin.
    A form that raises on the partial probe is still served (the kernel's partial rotary is
    only reached by calls the model's function could not take)."""
    if not callable(fn):
        return RotaryRecognition(None, f"{SLOT} is {type(fn).__name__}, not a function")
    try:
        signature = _plain_signature(fn)
    except (TypeError, ValueError) as exc:
        return RotaryRecognition(None, f"its signature cannot be read: {exc}")
    if signature not in _SIGNATURES:
        served = " or ".join(f"{SLOT}{s}" for s in _SIGNATURES)
        return RotaryRecognition(None, f"{SLOT}{signature} is not a slot signature ({served})")
    reasons = []
    for half_width in (False, True):
        call = RotaryCall(_SIGNATURES[signature], half_width)
        outcome = _matching_form(fn, call)
        if isinstance(outcome, RotaryForm):
            return RotaryRecognition(outcome, call=call)
        reasons.append(outcome)
    forms = "; ".join(f.describe() for f in ROTARY_FORMS)
    return RotaryRecognition(
        None,
        f"{reasons[0]}; with half-width cos/sin: {reasons[1]} (forms kernel-hub serves: {forms})",
    )


@functools.cache
def recognise_interleaved(fn: Callable[..., Any]) -> RotaryRecognition:
    """Which of ``ROTARY_FORMS`` the interleaved slot function ``fn`` computes on q and k
    de-interleaved with cos and sin's first half used twice, on every full-width probe; or why
    none (module docstring)."""
    if not callable(fn):
        return RotaryRecognition(None, f"{INTERLEAVE_SLOT} is {type(fn).__name__}, not a function")
    try:
        signature = _plain_signature(fn)
    except (TypeError, ValueError) as exc:
        return RotaryRecognition(None, f"its signature cannot be read: {exc}")
    if signature not in _INTERLEAVE_SIGNATURES:
        served = " or ".join(f"{INTERLEAVE_SLOT}{s}" for s in _INTERLEAVE_SIGNATURES)
        return RotaryRecognition(
            None, f"{INTERLEAVE_SLOT}{signature} is not a slot signature ({served})"
        )
    call = RotaryCall(pairs=True, position_ids=_INTERLEAVE_SIGNATURES[signature])
    outcome = _matching_form(fn, call)
    if isinstance(outcome, RotaryForm):
        return RotaryRecognition(outcome, call=call)
    forms = "; ".join(f.describe() for f in ROTARY_FORMS)
    return RotaryRecognition(
        None,
        f"{outcome}, on q and k de-interleaved with cos and sin's first half (forms kernel-hub "
        f"serves: {forms})",
    )


def _matching_form(fn: Callable[..., Any], call: RotaryCall) -> RotaryForm | str:
    """The first of ``ROTARY_FORMS`` ``fn`` computes on every probe called as ``call``, or why
    none does."""
    candidates = list(ROTARY_FORMS)
    for index, ((q, k, cos, sin), unsqueeze_dim) in enumerate(_probes()):
        partial = cos.shape[-1] < q.shape[-1]
        if call.pairs and partial:  # served at full width only
            continue
        if call.half_width:
            if partial:  # half-width cos/sin already look partial: no partial probe
                continue
            cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        try:
            with torch.no_grad():
                if call.single:
                    out = fn(q, cos, sin, unsqueeze_dim=unsqueeze_dim)
                else:
                    out = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        except Exception as exc:  # other layouts or state: not a form served here
            if partial:
                continue
            return f"on probe {index} it raised {type(exc).__name__}: {exc}"

        def expected(form: RotaryForm, q=q, k=k, cos=cos, sin=sin, unsqueeze_dim=unsqueeze_dim):
            if call.half_width:
                cos, sin = _widen(cos, form), _widen(sin, form)
            if call.pairs:
                q, k = _deinterleave(q), _deinterleave(k)
                cos, sin = _first_half_twice(cos), _first_half_twice(sin)
            return form.reference(q, k, cos, sin, unsqueeze_dim)

        candidates = [f for f in candidates if _same(out, expected(f), call.single)]
        if not candidates:
            dtypes = ", ".join(str(a.dtype).removeprefix("torch.") for a in (q, k, cos, sin))
            return (
                f"on probe {index} (q, k, cos, sin: {dtypes}; unsqueeze_dim={unsqueeze_dim}"
                f"{'; partial rotary' if partial else ''}) its result is none of the rotary "
                "forms"
            )
    return candidates[0]


def _served(q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether the kernel takes this call (else the model's own function runs)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        return False
    if cos.requires_grad or sin.requires_grad:
        return False
    seq_axis = 3 - unsqueeze_dim
    batch, seq, width = q.shape[0], q.shape[seq_axis], q.shape[-1]
    rot = cos.shape[-1]
    return (
        (k.shape[0], k.shape[seq_axis], k.shape[-1]) == (batch, seq, width)
        and cos.shape[0] in (1, batch)
        and cos.shape[1] == seq
        and rot % 2 == 0
        and 2 <= rot <= width
        and all(t.is_floating_point() for t in (q, k, cos))
    )


@functools.cache
def slot_function(
    stock: Callable[..., Any],
    kernel_apply: Callable[..., Any],
    form: RotaryForm,
    call: RotaryCall = RotaryCall(),
):
    """The function put in the slot, with the stock signature: the kernel for calls it serves,
    ``stock`` for the rest."""
    options = form.options

    def rotate(q, k, cos, sin, unsqueeze_dim):
        """The kernel's (q, k) for a call it serves, else None."""
        if call.half_width:
            tensors = all(isinstance(t, torch.Tensor) for t in (q, cos, sin))
            if not tensors or 2 * cos.shape[-1] != q.shape[-1]:
                return None
            cos, sin = _widen(cos, form), _widen(sin, form)
        if not _served(q, k, cos, sin, unsqueeze_dim):
            return None
        if call.pairs:
            if cos.shape[-1] != q.shape[-1]:
                return None
            q, k = _deinterleave(q), _deinterleave(k)
            cos, sin = _first_half_twice(cos), _first_half_twice(sin)
        return kernel_apply(q, k, cos, sin, unsqueeze_dim, **options)

    if call.single:

        def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
            # the kernel rotates q and k: k is one head of x, its result dropped (exact: its
            # gradient is zero)
            four_d = isinstance(x, torch.Tensor) and x.dim() == 4 and unsqueeze_dim in (1, 2)
            out = (
                rotate(x, x.narrow(unsqueeze_dim, 0, 1), cos, sin, unsqueeze_dim)
                if four_d
                else None
            )
            return stock(x, cos, sin, unsqueeze_dim) if out is None else out[0]

        function = apply_rotary_pos_emb
    elif call.position_ids:

        def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            # the stock function reads no position_ids: a call passing them runs it (as given)
            out = None if position_ids is not None else rotate(q, k, cos, sin, unsqueeze_dim)
            return stock(q, k, cos, sin, position_ids, unsqueeze_dim) if out is None else out

        function = apply_rotary_pos_emb_interleave
    else:

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            out = rotate(q, k, cos, sin, unsqueeze_dim)
            return stock(q, k, cos, sin, unsqueeze_dim) if out is None else out

        function = apply_rotary_pos_emb

    function.__wrapped__ = stock
    return function


@dataclass(frozen=True)
class ComplexRecognition:
    """The ``unsqueeze_dim`` of the layout an ``apply_rotary_emb`` rotates (2: [B, S, H, D],
    1: [B, H, S, D]) when it computes ``COMPLEX_FORM``, else why not."""

    unsqueeze_dim: int | None
    reason: str | None = None


def _complex_probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, S, H, D], k [B, S, 1, D] and a complex freqs_cis [B, S, D/2] whose magnitudes are
    not 1 (Llama 4 scales it by the rope's attention factor)."""
    generator = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(2, 5, 3, 8, generator=generator),
        torch.randn(2, 5, 1, 8, generator=generator),
    )
    magnitude = 0.5 + torch.rand(2, 5, 4, generator=generator)
    return q, k, torch.polar(magnitude, 3 * torch.randn(2, 5, 4, generator=generator))


def _cos_sin(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and sin of the interleaved form from complex ``freqs_cis``."""
    return (
        freqs_cis.real.repeat_interleave(2, dim=-1),
        freqs_cis.imag.repeat_interleave(2, dim=-1),
    )


def _within_rounding(out: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int):
    """Whether ``out`` is ``COMPLEX_FORM`` of x within the rounding of f32 arithmetic (4 f32
    epsilons of |x| (|cos| + |sin|), row by row) and of the cast to x's dtype (one ulp)."""
    if not (isinstance(out, torch.Tensor) and out.dtype == x.dtype and out.shape == x.shape):
        return False
    x64, cos64, sin64 = x.double(), cos.double(), sin.double()
    exact = COMPLEX_FORM.reference(x64, x64, cos64, sin64, dim)[0]
    scale = x64.abs().amax(-1, keepdim=True) * (cos64.abs() + sin64.abs()).unsqueeze(dim)
    bound = 4 * torch.finfo(torch.float32).eps * scale + torch.finfo(x.dtype).eps * exact.abs()
    return bool(((out.double() - exact).abs() <= bound).all())


@functools.cache
def recognise_complex_rotary(fn: Callable[..., Any]) -> ComplexRecognition:
    """Whether ``fn`` is ``COMPLEX_FORM`` (module docstring) on f32 and bf16 probes, in the one
    layout it runs on."""
    try:
        signature = _plain_signature(fn)
    except (TypeError, ValueError) as exc:
        return ComplexRecognition(None, f"its signature cannot be read: {exc}")
    if signature != _COMPLEX_SIGNATURE:
        return ComplexRecognition(
            None, f"{COMPLEX_SLOT}{signature} is not {COMPLEX_SLOT}{_COMPLEX_SIGNATURE}"
        )
    q, k, freqs_cis = _complex_probe()
    cos, sin = _cos_sin(freqs_cis)
    reasons = []
    for dim in (2, 1):
        qd, kd = (q, k) if dim == 2 else (q.transpose(1, 2), k.transpose(1, 2))
        for dtype in (torch.float32, torch.bfloat16):
            qi, ki = qd.to(dtype), kd.to(dtype)
            try:
                with torch.no_grad():
                    out = fn(qi, ki, freqs_cis)
            except Exception as exc:  # another layout, or not the form
                reasons.append(f"[{'B, S, H, D' if dim == 2 else 'B, H, S, D'}]: {exc}")
                break
            if not (
                isinstance(out, tuple)
                and len(out) == 2
                and all(
                    _within_rounding(o, t, cos, sin, dim)
                    for o, t in zip(out, (qi, ki), strict=True)
                )
            ):
                return ComplexRecognition(
                    None,
                    f"on a {dtype} probe its result is not {COMPLEX_FORM.describe()} on "
                    "cos = freqs_cis.real, sin = freqs_cis.imag, within f32 rounding",
                )
        else:
            return ComplexRecognition(dim)
    return ComplexRecognition(None, f"it runs on neither layout ({'; '.join(reasons)})")


@functools.cache
def complex_slot_function(stock: Callable[..., Any], kernel_apply: Callable[..., Any], dim: int):
    """The function put in the ``apply_rotary_emb`` slot: the kernel for calls it serves (full
    width, a complex freqs_cis needing no gradient), ``stock`` for the rest."""

    def apply_rotary_emb(xq, xk, freqs_cis):
        if (
            isinstance(freqs_cis, torch.Tensor)
            and freqs_cis.is_complex()
            and freqs_cis.dim() == 3
            and not freqs_cis.requires_grad
            and isinstance(xq, torch.Tensor)
            and 2 * freqs_cis.shape[-1] == xq.shape[-1]
        ):
            cos, sin = _cos_sin(freqs_cis)
            if _served(xq, xk, cos, sin, dim):
                return kernel_apply(xq, xk, cos, sin, dim, **COMPLEX_FORM.options)
        return stock(xq, xk, freqs_cis)

    apply_rotary_emb.__wrapped__ = stock
    return apply_rotary_emb


def _innermost_reading(fn: Any, name: str) -> Any | None:
    """The function in ``fn``'s ``__wrapped__`` chain whose code reads global ``name``."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and name in code.co_names:
            return fn
        fn = getattr(fn, "__wrapped__", None)
    return None


_SHADOWS: dict[tuple[str, tuple], types.ModuleType] = {}
"""(modeling module, slot values) -> its shadow module (see ``_shadow_globals``)."""


def _shadow_globals(scope: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The globals of a modeling module with the names of ``values`` set to them: the namespace
    of a shadow module registered in ``sys.modules`` (torch.compile resolves an inlined
    function's globals by importing its ``__name__``), refreshed from the modeling module on
    every call."""
    module_name = scope.get("__name__", "?")
    key = (module_name, tuple(sorted(values.items(), key=lambda item: item[0])))
    shadow = _SHADOWS.get(key)
    if shadow is None:
        shadow_name = f"_kernel_hub_rotary_slot_{len(_SHADOWS)}_{module_name.replace('.', '_')}"
        shadow = types.ModuleType(shadow_name)
        _SHADOWS[key] = shadow
        sys.modules[shadow_name] = shadow
    shadow_name = shadow.__name__
    shadow.__dict__.update(scope)
    shadow.__dict__.update({"__name__": shadow_name, **values})
    return shadow.__dict__


def _with_globals(fn: types.FunctionType, values: dict[str, Any]) -> types.FunctionType:
    """A copy of ``fn`` whose globals named in ``values`` are those values; a decorator's wrapper
    is copied with its closure pointing at the copy of the function it wraps (``__wrapped__``)."""
    inner = getattr(fn, "__wrapped__", None)
    closure = fn.__closure__
    new_inner = None
    reads = any(_code_reads(fn.__code__, name) for name in values)
    if not reads and isinstance(inner, types.FunctionType) and closure:
        new_inner = _with_globals(inner, values)
        closure = tuple(
            types.CellType(new_inner) if cell.cell_contents is inner else cell for cell in closure
        )
    scope = _shadow_globals(fn.__globals__, values) if reads else fn.__globals__
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    if new_inner is not None:
        copy.__wrapped__ = new_inner
    return copy


def stock_function(cls: type, slot: str = SLOT) -> Any:
    """The ``slot`` function (``apply_rotary_pos_emb``) ``cls.forward`` calls, or None."""
    reader = _innermost_reading(getattr(cls, "forward", None), slot)
    return None if reader is None else reader.__globals__.get(slot)


_RECOGNISERS = {SLOT: recognise_rotary, INTERLEAVE_SLOT: recognise_interleaved}
"""The slots decided by bit-for-bit probes -> their recogniser."""


def _plain_slots(cls: type) -> dict[str, Any]:
    """Slot -> the function ``cls.forward`` calls there, for each of ``_RECOGNISERS`` it calls."""
    found = {slot: stock_function(cls, slot) for slot in _RECOGNISERS}
    return {slot: fn for slot, fn in found.items() if fn is not None}


def _complex_slot(cls: type) -> tuple[Any, ComplexRecognition] | None:
    """(the ``apply_rotary_emb`` a Transformers class's forward calls, its recognition), or None
    when it calls none (or also a plain slot, which then decides)."""
    if not cls.__module__.startswith("transformers.") or _plain_slots(cls):
        return None
    stock = stock_function(cls, COMPLEX_SLOT)
    if stock is None:
        return None
    if not callable(stock):
        return stock, ComplexRecognition(None, f"{COMPLEX_SLOT} is {type(stock).__name__}")
    return stock, recognise_complex_rotary(stock)


def _global_names(cls: type) -> set[str]:
    names: set[str] = set()
    fn = getattr(cls, "forward", None)
    while fn is not None:
        code = getattr(fn, "__code__", None)
        names |= set(code.co_names) if code is not None else set()
        fn = getattr(fn, "__wrapped__", None)
    return names


def _code_reads(code: types.CodeType, name: str) -> bool:
    """Whether ``code`` or code nested in it (a comprehension, run with the function's globals)
    reads global ``name``."""
    return name in code.co_names or any(
        _code_reads(c, name) for c in code.co_consts if isinstance(c, types.CodeType)
    )


@functools.cache
def _nested(outer: types.FunctionType, function: Callable[..., Any]) -> types.FunctionType:
    """``outer`` calling ``function`` as its ``apply_rotary_pos_emb`` (one copy per pair, so a
    later kernelize reuses its shadow globals)."""
    return _with_globals(outer, {SLOT: function})


def _nested_slot(cls: type) -> tuple[str, types.FunctionType, RotaryRecognition] | None:
    """(name, function, the recognition of the slot it calls) when every other rotary function a
    Transformers class's forward calls (and it calls neither slot itself) is a function of its
    module that applies rotary through that module's ``apply_rotary_pos_emb`` (Gemma 4's vision
    ``apply_multidimensional_rope``: the input split in parts, each rotated by the slot); None
    otherwise."""
    if not cls.__module__.startswith("transformers.") or _plain_slots(cls):
        return None
    names = _global_names(cls)
    others = sorted(n for n in names if n != COMPLEX_SLOT and _OTHER_ROTARY.fullmatch(n))
    if len(others) != 1 or COMPLEX_SLOT in names:
        return None
    reader = _innermost_reading(getattr(cls, "forward", None), others[0])
    fn = reader.__globals__.get(others[0]) if reader is not None else None
    if not isinstance(fn, types.FunctionType) or not _code_reads(fn.__code__, SLOT):
        return None
    return others[0], fn, recognise_rotary(fn.__globals__.get(SLOT))


def unserved_rotary(cls: type) -> str | None:
    """Why a Transformers class whose forward applies another rotary function than the slot's
    (``_OTHER_ROTARY``) is not switched, or None."""
    if not cls.__module__.startswith("transformers."):
        return None
    names = _global_names(cls)
    complex_slot = _complex_slot(cls)
    if complex_slot is not None and complex_slot[1].unsqueeze_dim is None:
        return f"its {COMPLEX_SLOT}: {complex_slot[1].reason}"
    nested = _nested_slot(cls)
    if nested is not None:
        name, _, recognition = nested
        return None if recognition.form else f"its {name}'s {SLOT}: {recognition.reason}"
    served = {*_RECOGNISERS, *([COMPLEX_SLOT] if complex_slot is not None else [])}
    others = sorted(n for n in names if n not in served and _OTHER_ROTARY.fullmatch(n))
    if not others or names & set(_RECOGNISERS):
        return None
    slots = ", ".join(_RECOGNISERS)
    return (
        f"its forward applies rotary through {', '.join(others)}, not a rotary_pos_emb slot "
        f"({slots}); the rotary kernel serves only the slots"
    )


def _ours(module: torch.nn.Module) -> bool:
    """Whether the module's instance forward is still the one ``switch`` installed."""
    forward = module.__dict__.get("forward")
    function = getattr(forward, "__func__", None)
    return getattr(forward, "__self__", None) is module and _STATE in getattr(
        function, "__dict__", {}
    )


@dataclass
class _Installed:
    label: str
    modules: list[torch.nn.Module]


class RotarySlotInterface:
    """kernelize's switch of a model's ``rotary_pos_emb`` slot, shaped like its
    ``ModelInterface``s: the rotary kernel's ``integrations`` provides ``register() -> name``
    and ``apply_rotary``; ``switch`` probes each attention class's function and installs the
    instance forwards; ``restore`` removes them."""

    name: str = "rotary_pos_emb"
    kind: str = "rotary"
    op: str = "rotary"
    registry_bound: bool = True
    """kernelize skips the slot with a registry that has no rotary op (as it does gated MLPs)."""

    def dispatches(self, module: torch.nn.Module) -> bool:
        cls = type(module)
        if not cls.__module__.startswith("transformers."):
            return False
        complex_slot = _complex_slot(cls)
        if complex_slot is not None:
            return complex_slot[1].unsqueeze_dim is not None
        nested = _nested_slot(cls)
        if nested is not None:
            return nested[2].form is not None
        return bool(_plain_slots(cls))

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        found = []
        for name, module in model.named_modules():
            reason = unserved_rotary(type(module))
            if reason is not None:
                found.append((name, module, reason))
        return found

    def integration(self, kernel: types.ModuleType) -> Any:
        return recording_adapter(kernel, "apply_rotary", _FUNCTIONS)

    def model_problem(self, model: torch.nn.Module, modules: list) -> str | None:
        problems = {}
        for _, module in modules:
            cls = type(module)
            if "forward" in module.__dict__:
                problems[cls.__name__] = f"{cls.__name__}'s forward is already replaced"
                continue
            if _complex_slot(cls) is not None or _nested_slot(cls) is not None:
                continue  # dispatches only when recognised
            for slot, stock in _plain_slots(cls).items():
                recognition = _RECOGNISERS[slot](stock)
                if recognition.form is None:
                    problems[cls.__name__, slot] = f"{cls.__name__}'s {slot}: {recognition.reason}"
        return "; ".join(problems.values()) or None

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        state = model.__dict__.get(_STATE)
        in_place = state is not None and all(_ours(m) for m in state.modules)
        return {"": state.label if in_place else None}

    def switch(self, model: torch.nn.Module, name: Any) -> str:
        kernel_apply = _FUNCTIONS.get(name)
        if kernel_apply is None:
            raise KernelHubError(f"integrations.register() returned {name!r}, not a rotary name")
        modules = [m for _, m in model.named_modules() if self.dispatches(m)]
        forms = set()
        for module in modules:
            cls = type(module)
            complex_slot, nested = _complex_slot(cls), _nested_slot(cls)
            if nested is not None:
                name_called, outer, recognition = nested
                stock = outer.__globals__[SLOT]
                form, call = recognition.form, recognition.call
                described = ", ".join(filter(None, (form.describe(), call.describe())))
                forms.add(f"{described}, through {name_called}")
                function = slot_function(stock, kernel_apply, form, call)
                forward = _with_globals(cls.forward, {name_called: _nested(outer, function)})
            elif complex_slot is not None:
                stock, recognition = complex_slot
                forms.add(f"{COMPLEX_FORM.describe()}, complex freqs_cis")
                function = complex_slot_function(stock, kernel_apply, recognition.unsqueeze_dim)
                forward = _with_globals(cls.forward, {COMPLEX_SLOT: function})
            else:
                functions = {}
                for slot, stock in _plain_slots(cls).items():
                    recognition = _RECOGNISERS[slot](stock)
                    form, call = recognition.form, recognition.call
                    forms.add(", ".join(filter(None, (form.describe(), call.describe()))))
                    functions[slot] = slot_function(stock, kernel_apply, form, call)
                forward = _with_globals(cls.forward, functions)
            forward.__dict__[_STATE] = name
            module.__dict__["forward"] = types.MethodType(forward, module)
        label = f"{name} ({'; '.join(sorted(forms))})"
        model.__dict__[_STATE] = _Installed(label, modules)
        return label

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        self.discard(model)

    def discard(self, model: torch.nn.Module) -> None:
        """Drop the instance forwards still in place (other code may have replaced some: those
        keep that code's forward)."""
        state = model.__dict__.pop(_STATE, None)
        for module in state.modules if state is not None else ():
            if _ours(module):
                del module.__dict__["forward"]


_FUNCTIONS: dict[str, Any] = {}
"""Registered name -> the kernel's ``apply_rotary``."""
