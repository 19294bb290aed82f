"""Tiny random-weight Transformers checkpoints on disk (``kernel-hub tiny-model``), for loading
with ``from_pretrained`` offline: what a docs snippet or a first try needs instead of a Hub
download.

The model is ``build_tiny_model(name)`` (``kernel_hub.models.tiny``: its sizes, seeded weights);
the text models (``CAUSAL_LM_MODELS``) also get a character-level tokenizer made here: the
special tokens ``<pad>`` (the models' pad id 0), ``<s>`` (bos 1), ``</s>``, ``<unk>``, then one
token per printable ASCII character, so any English prompt encodes and decodes back. The others
(vision, audio, masked-LM) take inputs a text tokenizer cannot make and get none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernel_hub.errors import KernelHubError

from .tiny import CAUSAL_LM_MODELS, PAD_TOKEN_ID, build_tiny_model

SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}
CHARACTERS = [chr(code) for code in range(32, 127)]


def tiny_tokenizer() -> Any:
    """A character-level fast tokenizer (no download, no training): the special tokens, then
    one id per printable ASCII character; left padding, as decoder-only generation wants."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS.values(), *CHARACTERS])}
    assert vocab[SPECIAL_TOKENS["pad_token"]] == PAD_TOKEN_ID
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.decoder = decoders.Fuse()  # characters join back without spaces between them
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)


def save_tiny_checkpoint(name: str, directory: str | Path, seed: int = 0) -> list[Path]:
    """Write tiny model ``name`` (one of ``tiny.TINY_MODELS``) to ``directory``: its config and
    safetensors weights, and a tokenizer for the text models. Returns the files written.

    ``directory`` must not exist or be empty: a checkpoint is never written over other files."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise KernelHubError(f"{directory} is a file: give a directory for the checkpoint")
    if directory.is_dir() and any(directory.iterdir()):
        raise KernelHubError(
            f"{directory} is not empty: give a new or empty directory for the checkpoint"
        )
    model = build_tiny_model(name, seed=seed)  # an unknown name: UnknownNameError lists them
    model.save_pretrained(directory)
    if name in CAUSAL_LM_MODELS:
        tokenizer = tiny_tokenizer()
        if len(tokenizer) > model.config.vocab_size:
            raise KernelHubError(  # a TINY_SIZES change would make token ids overflow
                f"the tiny tokenizer has {len(tokenizer)} tokens, more than the tiny {name} "
                f"model's vocabulary ({model.config.vocab_size})"
            )
        tokenizer.save_pretrained(directory)
    return sorted(path for path in directory.rglob("*") if path.is_file())
