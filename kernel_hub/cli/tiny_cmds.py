"""``kernel-hub tiny-model ARCH DIR``: write a tiny random-weight Transformers checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import require_modules
from .output import print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    from kernel_hub.models.tiny import CAUSAL_LM_MODELS, TINY_MODELS

    parser = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random-weight Transformers checkpoint (config, safetensors, and a "
        "character-level tokenizer for text models) to load offline with from_pretrained",
    )
    parser.add_argument(
        "arch",
        metavar="ARCH",
        help=f"architecture: {', '.join(sorted(TINY_MODELS))} (tokenizer for "
        f"{', '.join(sorted(CAUSAL_LM_MODELS))})",
    )
    parser.add_argument("directory", metavar="DIR", help="new or empty directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_tiny_model_command)


def run_tiny_model_command(args: argparse.Namespace) -> int:
    from kernel_hub.models.tiny import TINY_MODELS

    if args.arch not in TINY_MODELS:  # before importing torch and transformers
        from kernel_hub.errors import UnknownNameError

        raise UnknownNameError("tiny model", args.arch, TINY_MODELS)
    require_modules("transformers")
    from kernel_hub.models.checkpoint import save_tiny_checkpoint

    files = save_tiny_checkpoint(args.arch, args.directory, seed=args.seed)
    config = json.loads((Path(args.directory) / "config.json").read_text(encoding="utf-8"))
    model_class = config["architectures"][0]
    tokenizer = any(f.name == "tokenizer.json" for f in files)
    if args.json:
        print_json(
            {
                "arch": args.arch,
                "directory": args.directory,
                "model_class": model_class,
                "tokenizer": tokenizer,
                "files": [str(f) for f in files],
            }
        )
        return 0
    names = ", ".join(f.name for f in files)
    print(f"wrote a tiny {args.arch} checkpoint to {args.directory}: {names}")
    load = f"transformers.{model_class}.from_pretrained({args.directory!r})"
    print(f"load it with {load}" + (" and AutoTokenizer.from_pretrained" if tokenizer else ""))
    return 0
