"""``Mode``: what a kernelized model will be used for, which decides the layers it may get.

A training model needs layers with a backward; a model that will be ``torch.compile``d needs layers
that compile. Exactly one of INFERENCE or TRAINING is set, TORCH_COMPILE may be added.
"""

from __future__ import annotations

import enum
import re

from kernel_hub.errors import KernelHubError, UnknownNameError


class Mode(enum.Flag):
    """``Mode.INFERENCE``, ``Mode.TRAINING``, either one ``| Mode.TORCH_COMPILE``."""

    INFERENCE = enum.auto()
    TRAINING = enum.auto()
    TORCH_COMPILE = enum.auto()

    def __or__(self, other: Mode) -> Mode:
        union = super().__or__(other)
        _check_exclusive(union)
        return union

    @classmethod
    def parse(cls, value: Mode | enum.Flag | str) -> Mode:
        """A ``Mode``, Hugging Face ``kernels.Mode`` (same names), or a string such as
        ``"training"`` or ``"inference+torch_compile"``."""
        if isinstance(value, Mode):
            return _checked(value)
        if isinstance(value, enum.Flag) and type(value).__module__.startswith("kernels."):
            value = _from_hf_kernels(value)
        if not isinstance(value, str):
            raise KernelHubError(
                "mode must be a kernel_hub.Mode, a kernels.Mode or a string, got "
                f"{type(value).__name__} {value!r}"
            )
        parts = [p.strip().lower() for p in re.split(r"[+|,]", value)]
        mode = cls(0)
        for part in parts:
            member = cls.__members__.get(part.upper())
            if member is None:
                raise UnknownNameError("mode", part, [m.lower() for m in cls.__members__])
            mode = enum.Flag.__or__(mode, member)
        return _checked(mode)

    @property
    def label(self) -> str:
        """``"training+torch_compile"``: the string ``parse`` reads back."""
        return "+".join(m.name.lower() for m in Mode if m in self)


def _from_hf_kernels(mode: enum.Flag) -> str:
    """Hugging Face ``kernels.Mode`` as the string ``parse`` reads: the flags share their names,
    except FALLBACK (kernels' "keep the original forward"), which kernel-hub does not take."""
    names = [member.name.lower() for member in type(mode) if member.value and member in mode]
    if "fallback" in names:
        raise KernelHubError(
            "kernels.Mode.FALLBACK has no kernel-hub counterpart: kernelize leaves a module stock "
            "by itself when no kernel fits; pass kernels.Mode.INFERENCE or kernels.Mode.TRAINING "
            "(| kernels.Mode.TORCH_COMPILE)"
        )
    return "+".join(names)


def _check_exclusive(mode: Mode) -> None:
    if Mode.INFERENCE in mode and Mode.TRAINING in mode:
        raise KernelHubError("Mode.INFERENCE and Mode.TRAINING exclude each other; pick one")


def _checked(mode: Mode) -> Mode:
    """Reject INFERENCE with TRAINING, and modes with neither (TORCH_COMPILE alone, empty)."""
    _check_exclusive(mode)
    if Mode.INFERENCE not in mode and Mode.TRAINING not in mode:
        raise KernelHubError(
            f"mode {mode!r} needs INFERENCE or TRAINING (TORCH_COMPILE is added to one of them, "
            "e.g. Mode.INFERENCE | Mode.TORCH_COMPILE or 'inference+torch_compile')"
        )
    return mode
