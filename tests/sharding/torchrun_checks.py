"""kernel-hub ops under torch.distributed: run with ``torchrun --nproc-per-node 2 rank_checks.py
torchrun_checks`` (gloo, CPU). Checks: DTensor inputs to rms_norm (sequence-parallel)
and to attention (heads) through the ops' registered strategies, forward and backward; a tiny
Llama with Transformers' tensor-parallel plan and a tiny Mixtral with its expert-parallel plan
(``AllToAllEP`` kernelized for training: moe-gemm; the default ``auto`` at inference: fused-moe
on each rank's local experts), expert-split DTensor weights without that plan and quantized
experts whose scales the plan leaves whole left alone with the reason, and a tiny Flux under
Diffusers' ``TensorParallelConfig`` and ``ContextParallelConfig``, kernelized, against the
unsharded stock models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kernel_hub import get_kernel

TOL = 1e-5
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def err(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


@check
def dtensor_rms_norm(mesh):
    rms = get_kernel("rms_norm").rms_norm
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).requires_grad_()
    ref = rms(x, w, 1e-6)
    ref.sum().backward()
    ref_dx, ref_dw = x.grad.clone(), w.grad.clone()
    dx_in = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
    dw_in = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
    out = rms(dx_in, dw_in, 1e-6)
    out.sum().backward()
    placements = [str(p) for p in out.placements]
    ok_types = isinstance(out, DTensor) and out.placements == (Shard(1),)
    errors = {
        "forward": err(out.full_tensor(), ref),
        "dx": err(dx_in.grad.full_tensor(), ref_dx),
        "dw": err(dw_in.grad.full_tensor(), ref_dw),
    }
    local = list(out.to_local().shape)
    return {
        "ok": ok_types and local == [2, 4, 64] and max(errors.values()) <= TOL,
        "placements": placements,
        "local_shape": local,
        **errors,
    }


@check
def dtensor_attention_heads(mesh):
    """Head-split DTensors (query and kv heads together) through attention_with_lse."""
    attention = get_kernel("attention").attention_with_lse
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16, 32, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(2))
    ref_out, ref_lse = attention(q, k, v, causal=True)
    (ref_out.sum() + ref_lse.sum()).backward()
    shard = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v)]
    out, lse = attention(*shard, causal=True)
    (out.sum() + lse.sum()).backward()
    errors = {
        "forward": max(err(out.full_tensor(), ref_out), err(lse.full_tensor(), ref_lse)),
        "grads": max(
            err(s.grad.full_tensor(), t.grad) for s, t in zip(shard, (q, k, v), strict=True)
        ),
    }
    placements = [str(p) for p in out.placements + lse.placements]
    return {
        "ok": placements == ["S(1)", "S(1)"] and max(errors.values()) <= TOL,
        "placements": placements,
        **errors,
    }


@check
def dtensor_dense_mask_heads(mesh):
    """DTensors through attention_with_dense_mask with a key-padding mask [B, 1, S, S] and a bias
    [1, H, S, S]. Heads split: the mask (heads broadcast) is replicated, the bias split with the
    heads and so is its gradient. Batch split: the mask follows, the bias (batch broadcast) is
    read whole and its gradient comes back a partial sum, summed over the ranks."""
    attention = get_kernel("attention").attention_with_dense_mask
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 32, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 32, requires_grad=True) for _ in range(2))
    bias = (0.5 * torch.randn(1, 4, 16, 16)).requires_grad_()
    mask = (torch.arange(16) < torch.tensor([12, 16])[:, None])[:, None, None, :].expand(
        2, 1, 16, 16
    )
    ref_out, ref_lse = attention(q, k, v, mask, bias=bias)
    (ref_out.sum() + ref_lse.sum()).backward()
    leaves = (q, k, v, bias)
    shard = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in leaves]
    dmask = distribute_tensor(mask.contiguous(), mesh, [Replicate()])
    out, lse = attention(*shard[:3], dmask, bias=shard[3])
    (out.sum() + lse.sum()).backward()
    errors = {
        "forward": max(err(out.full_tensor(), ref_out), err(lse.full_tensor(), ref_lse)),
        "grads": max(err(s.grad.full_tensor(), t.grad) for s, t in zip(shard, leaves, strict=True)),
    }
    placements = [str(p) for p in out.placements + lse.placements + shard[3].grad.placements]
    # batch split: the mask follows it, the [1, H] bias is read whole and its gradient summed
    batch = [distribute_tensor(t.detach(), mesh, [Shard(0)]).requires_grad_() for t in leaves[:3]]
    whole_bias = distribute_tensor(bias.detach(), mesh, [Replicate()]).requires_grad_()
    bmask = distribute_tensor(mask.contiguous(), mesh, [Shard(0)])
    out, lse = attention(*batch, bmask, bias=whole_bias)
    (out.sum() + lse.sum()).backward()
    errors["batch_forward"] = max(err(out.full_tensor(), ref_out), err(lse.full_tensor(), ref_lse))
    errors["batch_grads"] = max(
        err(s.grad.full_tensor(), t.grad) for s, t in zip([*batch, whole_bias], leaves, strict=True)
    )
    batch_placements = [str(p) for p in out.placements]
    return {
        "ok": placements == ["S(1)", "S(1)", "S(1)"]
        and batch_placements == ["S(0)"]
        and max(errors.values()) <= TOL,
        "placements": placements,
        "batch_placements": batch_placements,
        **errors,
    }


def _llama():
    from transformers import LlamaForCausalLM

    from kernel_hub.models.tiny import tiny_model

    return tiny_model(LlamaForCausalLM)


def _mixtral():
    from transformers import MixtralForCausalLM

    from kernel_hub.models.tiny import tiny_model

    return tiny_model(
        MixtralForCausalLM, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
    )


def _compare_parallel(build, mesh, apply, mode: str = "inference"):
    from kernel_hub import kernelize

    stock = build()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = stock(ids).logits
    model = build()
    apply(model, mesh)
    report = kernelize(model, mode=mode, device="cpu")
    with torch.no_grad():
        got = model(ids).logits
    got = got.full_tensor() if isinstance(got, DTensor) else got
    return err(got, expected), report, model


def _local_shape(tensor) -> list[int]:
    return list((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape)


@check
def llama_tensor_parallel(mesh):
    from transformers.distributed import DistributedConfig
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    def apply(model, mesh):
        plan = model._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
        apply_tensor_parallelism(model, mesh, plan)

    error, report, model = _compare_parallel(_llama, mesh, apply)
    swapped = str(report)
    q_proj = _local_shape(model.model.layers[0].self_attn.q_proj.weight)  # 2 of 4 heads
    return {
        "ok": error <= TOL and "kernel_hub_attention" in swapped and q_proj == [32, 64],
        "error": error,
        "local_q_proj": q_proj,
        "report": swapped[:600],
    }


@check
def mixtral_expert_parallel(mesh):
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    def apply(model, mesh):
        plans = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
        apply_expert_parallelism(model, mesh, mesh, plans[1], ep_implementation="all_to_all")

    # training mode: moe-gemm's gmm (with its backward kernels) on each rank's local experts
    error, report, model = _compare_parallel(_mixtral, mesh, apply, mode="training")
    swapped = str(report)
    experts = _local_shape(model.model.layers[0].mlp.experts.gate_up_proj)  # 2 of 4 experts
    return {
        "ok": error <= TOL and "kernel_hub_moe_gemm" in swapped and experts[0] == 2,
        "error": error,
        "local_gate_up": experts,
        "report": swapped[:900],
    }


@check
def mixtral_expert_parallel_inference(mesh):
    """Transformers' default EP transport at inference (``auto``: every rank holds the batch,
    runs its experts on it, one all-reduce; the scheme of fused-moe's ``fused_experts_ep``):
    kernelize in inference mode runs the fused kernel on each rank's local experts."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    def apply(model, mesh):
        plans = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
        apply_expert_parallelism(model, mesh, mesh, plans[1])

    error, report, _ = _compare_parallel(_mixtral, mesh, apply)
    swapped = str(report)
    return {
        "ok": error <= TOL and "kernel_hub_fused_moe" in swapped,
        "error": error,
        "report": swapped[:900],
    }


@check
def dtensor_experts_without_ep_dispatch_are_left_alone(mesh):
    """Expert weights split over experts as DTensors, with no expert-parallel dispatch around
    the experts (tokens are not sent to the rank owning their expert): neither MoE kernel can
    run them exactly, so kernelize leaves them alone with the reason (training and inference)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from kernel_hub import kernelize, unkernelize

    def apply(model, mesh):
        for module in model.modules():
            if type(module).__name__ == "MixtralExperts":
                for name in ("gate_up_proj", "down_proj"):
                    weight = getattr(module, name)
                    split = distribute_tensor(weight.detach(), mesh, [Shard(0)])
                    setattr(module, name, torch.nn.Parameter(split, requires_grad=False))

    reasons = {}
    for mode in ("inference", "training"):
        model = _mixtral()
        apply(model, mesh)
        report = kernelize(model, mode=mode, device="cpu")
        experts = [e for e in report.entries if e.kind == "experts"]
        reasons[mode] = [str(e) for e in experts]
        if any(e.swapped for e in experts) or not experts:
            return {"ok": False, "mode": mode, "report": str(report)[:900]}
        unkernelize(model)
    return {
        "ok": all(
            "without an expert-parallel dispatch" in r for rs in reasons.values() for r in rs
        ),
        "reasons": {m: r[:1] for m, r in reasons.items()},
    }


@check
def quantized_experts_under_ep_plan_are_left_alone(mesh):
    """Transformers' expert-parallel plan splits gate_up_proj / down_proj but not the scales
    ``quantize_experts`` adds: both MoE kernels leave the experts alone, naming them."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from kernel_hub import kernelize, quantize_experts

    reasons = {}
    for mode in ("inference", "training"):
        model = _mixtral()
        quantize_experts(model, "int8")
        plans = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
        apply_expert_parallelism(model, mesh, mesh, plans[1])
        report = kernelize(model, mode=mode, device="cpu")
        experts = [e for e in report.entries if e.kind == "experts"]
        if not experts or any(e.swapped for e in experts):
            return {"ok": False, "mode": mode, "report": str(report)[:900]}
        reasons[mode] = str(experts[0])
    return {
        "ok": all(
            "leaves gate_up_proj_scale, down_proj_scale whole" in r for r in reasons.values()
        ),
        "reasons": reasons,
    }


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.tensor([0.5, 0.7]),
        "img_ids": torch.randn(16, 3, generator=g),
        "txt_ids": torch.zeros(8, 3),
    }
    return model, inputs


@check
def diffusers_flux_tensor_parallel(mesh):
    """A tiny Flux under Diffusers' TensorParallelConfig (its model's ``_tp_plan``: attention
    heads and MLPs split over the ranks), kernelized: equal to the unsharded stock model within
    1e-5, the kernels running on each rank's heads. ``enable_parallelism`` needs an accelerator
    (it divides by ``torch.accelerator.device_count()``) and Diffusers lists no CPU TP device, so
    the check does on CPU what it does for TP: set the config up and apply the plan."""
    import diffusers.hooks.tensor_parallel as tp_hooks
    from diffusers.models._modeling_parallel import TensorParallelConfig

    from kernel_hub import kernelize

    stock, inputs = _tiny_flux()
    with torch.no_grad():
        expected = stock(**inputs).sample
    model, _ = _tiny_flux()
    supported = tp_hooks._SUPPORTED_TP_DEVICES
    tp_hooks._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    try:
        config = TensorParallelConfig(mesh=mesh)
        config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh)
        tp_hooks.apply_tensor_parallel(model, config, model._tp_plan)
    finally:
        tp_hooks._SUPPORTED_TP_DEVICES = supported
    report = kernelize(model, device="cpu")
    with torch.no_grad():
        got = model(**inputs).sample
    got = got.full_tensor() if isinstance(got, DTensor) else got
    error = float((got - expected).abs().max())
    swapped = str(report)
    # the only layers left alone are the per-head q/k norms kernelize leaves to XLA before
    # Flux's rotary (2 per stream and block), not TP-split layers
    left_alone = [line for line in swapped.splitlines() if ": left alone: " in line]
    to_q = _local_shape(model.transformer_blocks[0].attn.to_q.weight)  # 1 of 2 heads
    return {
        "ok": error <= TOL
        and len(left_alone) == 6
        and all("a per-head q/k norm before" in line for line in left_alone)
        and "attention" in swapped
        and to_q == [16, 32],
        "error": error,
        "local_to_q": to_q,
        "report": swapped[:400],
    }


@check
def diffusers_flux_context_parallel(mesh):
    """A tiny Flux under Diffusers' ContextParallelConfig (Ulysses over the ranks: sequence
    split, all-to-all around attention), kernelized: the norms run on the sequence shards, the
    attention processors (context parallel) are left alone with the reason, and the output
    equals the unsharded stock model within 1e-5. Set up as ``enable_parallelism`` does, which
    needs an accelerator."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    from kernel_hub import kernelize

    stock, inputs = _tiny_flux()
    with torch.no_grad():
        expected = stock(**inputs).sample
    model, _ = _tiny_flux()
    size = dist.get_world_size()
    cp_mesh = init_device_mesh("cpu", (1, size), mesh_dim_names=("ring", "ulysses"))
    context = ContextParallelConfig(ulysses_degree=size, mesh=cp_mesh)
    config = ParallelConfig(context_parallel_config=context)
    config.setup(dist.get_rank(), size, torch.device("cpu"), mesh=cp_mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(model, context, model._cp_plan)
    report = kernelize(model, device="cpu")
    with torch.no_grad():
        got = model(**inputs, return_dict=False)[0]  # the CP output hook takes plain tensors
    error = float((got - expected).abs().max())
    swapped = str(report)
    return {
        "ok": error <= TOL
        and "runs context parallel attention" in swapped
        and "layernorm" in swapped,
        "error": error,
        "report": swapped[-400:],
    }
