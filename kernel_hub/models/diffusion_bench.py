"""One denoising step of a Diffusers transformer for ``kernel-hub model-bench``: Flux's
``FluxTransformer2DModel`` on the meta device, its double-stream (``transformer_blocks``) and
single-stream (``single_transformer_blocks``) blocks as the two layer types the bench scales by.

An image of ``P x P`` pixels is ``(P / 16)^2`` image tokens (the VAE downsamples by 8, Flux packs
2 x 2 latent patches into one token), beside ``TEXT_TOKENS`` T5 tokens (FLUX.1-dev's
``max_sequence_length``). The step is one forward of the transformer (what a sampler calls per
denoising step, with guidance embedded for a guidance-distilled model), returning the predicted
noise of every image token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kernel_hub.errors import KernelInputError

FLUX = "FluxTransformer2DModel"
DOUBLE, SINGLE = "double_stream", "single_stream"
TEXT_TOKENS = 512
PIXELS_PER_TOKEN = 16
"""VAE downsampling (8) x Flux's 2 x 2 latent packing."""


@dataclass(frozen=True)
class DiffusionStep:
    """``function(params, buffers, *inputs)`` returns the predicted noise; ``inputs`` abstract."""

    function: Callable[..., Any]
    inputs: tuple[Any, ...]


def layer_types(fields: Mapping[str, Any]) -> list[str]:
    """The block type of every block, in order."""
    return [DOUBLE] * int(fields.get("num_layers", 19)) + [SINGLE] * int(
        fields.get("num_single_layers", 38)
    )


def image_tokens(pixels: int) -> int:
    if pixels < PIXELS_PER_TOKEN or pixels % PIXELS_PER_TOKEN:
        raise KernelInputError(
            f"--image {pixels}: Flux takes images whose side is a multiple of {PIXELS_PER_TOKEN} "
            "pixels (VAE x8, 2 x 2 packing)"
        )
    return (pixels // PIXELS_PER_TOKEN) ** 2


def build(model_class: str, fields: Mapping[str, Any], kinds: list[str]) -> Any:
    """The transformer on the meta device, bf16, with the blocks of types ``kinds``."""
    import torch

    if model_class != FLUX:
        raise KernelInputError(f"model-bench builds the Diffusers model {FLUX}, not {model_class}")
    from diffusers import FluxTransformer2DModel

    config = {**fields, "num_layers": kinds.count(DOUBLE), "num_single_layers": kinds.count(SINGLE)}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    return model.to(torch.bfloat16).eval()


def step(model: Any, batch: int, pixels: int, abstract: Callable[..., Any]) -> DiffusionStep:
    """One denoising step over a ``pixels`` x ``pixels`` image and ``TEXT_TOKENS`` text tokens;
    ``abstract(shape, dtype)`` makes an abstract argument."""
    import jax.numpy as jnp
    import torch
    import torchax

    env = torchax.default_env()
    config = model.config
    tokens = image_tokens(pixels)
    inputs = (
        abstract((batch, tokens, config.in_channels), jnp.bfloat16),
        abstract((batch, TEXT_TOKENS, config.joint_attention_dim), jnp.bfloat16),
        abstract((batch, config.pooled_projection_dim), jnp.bfloat16),
        abstract((batch,), jnp.bfloat16),  # timestep
        abstract((tokens, 3), jnp.bfloat16),  # image position ids
        abstract((TEXT_TOKENS, 3), jnp.bfloat16),  # text position ids
        abstract((batch,), jnp.bfloat16),  # guidance (ignored by a model without its embedding)
    )

    def forward(params: Any, buffers: Any, *arrays: Any) -> Any:
        t_params, t_buffers, t_arrays = env.j2t_iso((params, buffers, arrays))
        hidden, text, pooled, timestep, img_ids, txt_ids, guidance = t_arrays
        kwargs = {
            "hidden_states": hidden,
            "encoder_hidden_states": text,
            "pooled_projections": pooled,
            "timestep": timestep,
            "img_ids": img_ids,
            "txt_ids": txt_ids,
            "guidance": guidance if config.guidance_embeds else None,
            "return_dict": False,
        }
        with env:
            out = torch.func.functional_call(model, {**t_params, **t_buffers}, (), kwargs)
            return env.t2j_iso(out[0])

    return DiffusionStep(forward, inputs)
