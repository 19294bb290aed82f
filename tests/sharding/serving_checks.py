"""Continuous batching with attention heads split over tensor parallelism: run with ``torchrun
--nproc-per-node N rank_checks.py serving_checks`` (gloo, CPU), N = 2 or 4.

A tiny Llama under Transformers' tensor-parallel plan (``apply_tensor_parallelism``; the model
records the mesh and plan as ``from_pretrained(tp_plan=...)`` does, which is what Transformers'
paged cache reads to hold 1/N of the kv heads), kernelized, serves four prompts with kernel-hub's
``generate_batch`` (chunked prefill mixed with decode; then with block tables, so decode batches
take the paged kernel): its greedy tokens must equal the unsharded stock model's ``generate()``,
and the Pallas ragged and paged kernels must have run on each rank's local heads. The same
model generates with the fp8 static KV cache (``static_kv_cache``): each rank caches its kv heads
in fp8 and the tokens equal the unsharded model's with that cache.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernel_hub import get_kernel, kernelize
from kernel_hub.testing import greedy_continuations

PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([30, 3, 19, 5])]
HEADS, KV_HEADS = 8, 4
MESH_DIM = "tp"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def _llama():
    from transformers import LlamaForCausalLM

    from kernel_hub.models.tiny import tiny_model

    return tiny_model(
        LlamaForCausalLM,
        hidden_size=128,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        pad_token_id=0,
    )


def on_reporting_rank(reference):
    """``reference()`` on rank 0, the rank whose results ``main`` prints; None elsewhere. The
    unsharded references are the same on every rank: the other ranks would only build, compile
    and run them again (N times the reference's work for one reported comparison)."""
    return reference() if dist.get_rank() == 0 else None


def _recorded_heads():
    """Record the query heads each Pallas serving kernel traces with (Pallas put first)."""
    import jax

    api = get_kernel("ragged_attention").jax
    seen = {"ragged": set(), "paged": set()}
    for table in (api.RAGGED_TABLE, api.PAGED_TABLE):
        table.set_order("cpu", ("pallas", "xla"))
    for kind, module, name in (
        ("ragged", api.pallas_ragged, "ragged_attention"),
        ("paged", api.pallas_paged, "paged_attention"),
    ):
        original = getattr(module, name)

        def record(*args, original=original, kind=kind, **kwargs):
            seen[kind].add(args[0].shape[-2])
            return original(*args, **kwargs)

        setattr(module, name, record)
    jax.clear_caches()
    return seen


@check
def tensor_parallel_continuous_batching(mesh):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.distributed import DistributedConfig
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    from kernel_hub.layers.integrations.continuous_batching import generate_batch

    greedy = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = on_reporting_rank(lambda: greedy_continuations(_llama(), PROMPTS, greedy))
    model = _llama()
    size = mesh.size()
    apply_tensor_parallelism(
        model, mesh, model._resolve_parallel_plans(DistributedConfig(tp_size=size))[0]
    )
    model._device_mesh, model.tp_plan = mesh, dict(model.config.base_model_tp_plan)
    report = kernelize(model)
    heads = _recorded_heads()

    def serve(**extra):
        config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=24, page_size=16, **extra)
        results = generate_batch(
            model, PROMPTS, generation_config=greedy, continuous_batching_config=config
        )
        return [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]

    got = serve()  # chunked prefill and decode through the ragged kernel
    paged = serve(max_blocks_per_request=4)  # decode batches through the paged kernel
    swapped = [e for e in report.entries if e.kind == "continuous batching" and e.swapped]
    local = {HEADS // size}
    return {
        "ok": got == paged == expected
        and bool(swapped)
        and heads["ragged"] == heads["paged"] == local,
        "tp": size,
        "tokens": got,
        "tokens_paged": paged,
        "expected": expected,
        "heads_seen": {k: sorted(v) for k, v in heads.items()},
    }


@check
def tensor_parallel_8bit_static_cache(mesh):
    """``generate`` with the fp8 static cache (``static_kv_cache``) on the tensor-parallel model:
    each rank's cache holds its 1/N of the kv heads in fp8, and the greedy tokens equal the
    unsharded kernelized model's with the same cache (quantization is per token and kv head, so
    splitting heads does not change what is cached)."""
    from transformers import GenerationConfig
    from transformers.distributed import DistributedConfig
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    from kernel_hub.layers.integrations.static_kv_cache import static_kv_cache

    ids = torch.tensor([prompt[:11] for prompt in PROMPTS if len(prompt) >= 11])
    greedy = GenerationConfig(
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
        cache_implementation="static",
        return_dict_in_generate=True,
    )

    def generate(model):
        with torch.no_grad(), static_kv_cache(model, "float8_e4m3fn", page_size=8):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
        return out.sequences[:, ids.shape[1] :].tolist(), out.cache.layers[0].k_pages

    def unsharded_tokens():
        unsharded = _llama()
        kernelize(unsharded)
        return generate(unsharded)[0]

    expected = on_reporting_rank(unsharded_tokens)
    model = _llama()
    size = mesh.size()
    apply_tensor_parallelism(
        model, mesh, model._resolve_parallel_plans(DistributedConfig(tp_size=size))[0]
    )
    model._device_mesh, model.tp_plan = mesh, dict(model.config.base_model_tp_plan)
    kernelize(model)
    got, pages = generate(model)
    return {
        "ok": got == expected
        and pages.dtype == torch.float8_e4m3fn
        and pages.shape[2] == KV_HEADS // size,
        "tp": size,
        "tokens": got,
        "expected": expected,
        "pages": [str(pages.dtype), list(pages.shape)],
    }


@check
def expert_parallel_continuous_batching(mesh):
    """A tiny Mixtral with its experts split over the ranks (Transformers' expert-parallel plan,
    ``AllToAllEP``; attention replicated), kernelized, serves the prompts: every rank runs the
    same batches, its MoE layers the fused MoE kernel on its local experts only (inside the
    plan's dispatch and combine)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig, MixtralForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from kernel_hub.layers.integrations.continuous_batching import generate_batch
    from kernel_hub.models.tiny import tiny_model

    def mixtral():
        return tiny_model(
            MixtralForCausalLM,
            intermediate_size=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
        )

    greedy = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = on_reporting_rank(lambda: greedy_continuations(mixtral(), PROMPTS, greedy))
    model = mixtral()
    size = mesh.size()
    plans = model._resolve_parallel_plans(DistributedConfig(tp_size=size, ep_size=size))
    apply_expert_parallelism(model, mesh, mesh, plans[1], ep_implementation="all_to_all")
    report = kernelize(model)
    config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=24, page_size=16)
    results = generate_batch(
        model, PROMPTS, generation_config=greedy, continuous_batching_config=config
    )
    got = [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    local = list((experts.to_local() if hasattr(experts, "to_local") else experts).shape)
    swapped = str(report)
    return {
        "ok": got == expected and "kernel_hub_fused_moe" in swapped and local[0] == 4 // size,
        "ep": size,
        "tokens": got,
        "expected": expected,
        "local_gate_up": local,
    }
