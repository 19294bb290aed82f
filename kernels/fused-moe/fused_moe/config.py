"""The static description of an experts layer: weight layout, activation, quantization."""

from __future__ import annotations

from dataclasses import dataclass, field

from .activations import Activation


@dataclass(frozen=True)
class ExpertsConfig:
    """How the expert weights are laid out and what the experts compute.

    ``transposed``: weights are [E, in, out] (GPT-OSS) instead of Transformers' [E, out, in].
    ``interleaved``: gate and up columns alternate (gate0, up0, gate1, ...) instead of [gate; up].
    ``quantization``: None, "int8", "fp8", "mxfp4" or "w8a8" (see ``quant``). mxfp4 weights hold two
    values per byte along the contraction axis, so their last axis is half the logical one.
    """

    activation: Activation = field(default_factory=Activation)
    transposed: bool = False
    interleaved: bool = False
    quantization: str | None = None

    def intermediate(self, w_gate_up_shape: tuple[int, ...]) -> int:
        return w_gate_up_shape[2 if self.transposed else 1] // 2

    @property
    def weight_format(self) -> str | None:
        """How the weights are stored: w8a8 stores int8's."""
        return "int8" if self.quantization == "w8a8" else self.quantization

    @property
    def packing(self) -> int:
        """Logical values per stored element along the contraction axis."""
        return 2 if self.quantization == "mxfp4" else 1

    def hidden(self, w_gate_up_shape: tuple[int, ...]) -> int:
        return w_gate_up_shape[1] if self.transposed else w_gate_up_shape[2] * self.packing
