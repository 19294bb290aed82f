"""Which form the rotary_pos_emb probe finds for every Transformers ``apply_rotary_pos_emb``.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python scripts/rotary_slot_census.py

Prints, per form (or refusal reason), how many modeling files have it and some of their model
types. Figures in docs/training-kernels.md (transformers 5.24).
"""

from __future__ import annotations

import collections
import importlib
import pathlib
import warnings

import transformers

from kernel_hub.layers.integrations.rotary_slot import SLOT, recognise_rotary


def census() -> dict[str, list[str]]:
    root = pathlib.Path(transformers.__file__).parent / "models"
    found: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(root.glob("*/modeling_*.py")):
        if f"def {SLOT}(" not in path.read_text():
            continue
        name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # an optional dependency missing: counted, not probed
            found[f"not imported: {type(exc).__name__}"].append(path.parent.name)
            continue
        recognition = recognise_rotary(getattr(module, SLOT))
        key = recognition.form.describe() if recognition.form else f"refused: {recognition.reason}"
        found[key].append(path.parent.name)
    return found


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    results = census()
    print(f"{sum(map(len, results.values()))} modeling files define {SLOT}")
    for key, models in sorted(results.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(models):4d}  {key[:160]}  ({', '.join(models[:6])}, ...)")
