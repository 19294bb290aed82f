"""``kernel-hub model-bench`` on a multi-chip topology: a small Llama sharded over a deviceless
v5e 2x2 mesh (Transformers' TP plan over 2 chips, FSDP over 2) and a small Qwen3-MoE decode step
(TP and EP plans over 4), stock and kernelized; and how the plans map to parameter dimensions.
The real-size sharded cells are in docs/model-bench.md.
"""

from __future__ import annotations

import importlib.util

import pytest
from model_bench_cells import ran, run_cells, selected, set_args

from kernel_hub.cli import main
from kernel_hub.errors import KernelInputError
from kernel_hub.models.bench_sharding import _plan_entry, placement, topology_chips

LLAMA_PLAN = {
    "lm_head": "colwise_gather_output",
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("model.layers.3.self_attn.q_proj.weight", 0),
        ("model.layers.3.self_attn.q_proj.bias", 0),
        ("model.layers.3.self_attn.o_proj.weight", -1),  # rowwise: the input features, last
        ("model.layers.3.self_attn.o_proj.bias", None),  # rowwise: the bias is whole
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
        ("model.layers.3.input_layernorm.weight", None),
    ],
)
def test_the_tp_plan_names_the_split_dimension(name, dim):
    assert _plan_entry(LLAMA_PLAN, name)[1] == dim


def test_an_unknown_tp_style_is_refused_not_guessed():
    with pytest.raises(KernelInputError, match="'packed_colwise' is not one model-bench shards"):
        _plan_entry(
            {"model.layers.*.mlp.gate_up_proj": "packed_colwise"},
            "model.layers.0.mlp.gate_up_proj.weight",
        )
    with pytest.raises(KernelInputError, match="expected a chip grid such as 2x2"):
        topology_chips("four")
    assert topology_chips("4x4") == 16


QWEN3_MOE_PLAN = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}


def test_replicated_norms_split_nothing_and_tp_1_reads_no_plan():
    """Qwen3-MoE's plan: its q/k norms stay whole; with ``--tp 1`` (FSDP alone over the 4
    chips) its expert style, which model-bench does not map, is never read, and the experts
    split their first dimension over ``fsdp``; with ``--tp 2`` the style is refused."""
    assert _plan_entry(QWEN3_MOE_PLAN, "model.layers.0.self_attn.q_norm.weight")[1] is None
    model = type("Qwen3MoeLike", (), {"_tp_plan": QWEN3_MOE_PLAN})()
    fsdp_only = placement("v5e", "2x2", 1, model)
    experts = fsdp_only.weight("model.layers.0.mlp.experts.gate_up_proj", (128, 1536, 2048))
    assert tuple(experts.spec) == ("fsdp", None, None)
    with pytest.raises(KernelInputError, match="'moe_tp_experts' is not one model-bench shards"):
        placement("v5e", "2x2", 2, model).weight(
            "model.layers.0.mlp.experts.gate_up_proj", (128, 1536, 2048)
        )


def test_the_ep_plan_splits_the_experts_and_replaces_the_tp_plan_on_them():
    """Qwen3-MoE's TP plan (its expert styles unmapped) with its EP plan: the EP entries replace
    the TP ones on the experts and their parameters, as Transformers resolves both plans, so the
    expert weights split by expert over ``model`` and the decode rules run the fused experts
    kernel expert-parallel; attention keeps the TP plan."""
    tp_plan = {
        **QWEN3_MOE_PLAN,
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
    }
    ep_plan = {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    model = type("Qwen3MoeLike", (), {"_tp_plan": tp_plan, "_ep_plan": ep_plan})()
    place = placement("v5e", "2x2", 2, model)
    assert place.splits_experts and "EP plan (experts) over model x fsdp" in place.describe()
    assert set(place.plan) == set(ep_plan) | {
        "model.layers.*.self_attn.q_norm",
        "model.layers.*.self_attn.q_proj",
    }
    # the experts split over every chip, each chip's whole (no fsdp split of another dim)
    gate_up = place.weight("model.layers.0.mlp.experts.gate_up_proj", (128, 1536, 2048))
    down = place.weight("model.layers.0.mlp.experts.down_proj", (128, 2048, 768))
    assert tuple(gate_up.spec) == tuple(down.spec) == (("model", "fsdp"), None, None)
    q_proj = place.weight("model.layers.0.self_attn.q_proj.weight", (4096, 2048))
    assert tuple(q_proj.spec) == ("model", "fsdp")
    assert place.kernel_axis_rules("decode", 64)["experts"] == ("model", "fsdp")
    # prefill: the conventions, with the experts split as their weights are (fused-moe runs
    # each chip's experts); training keeps the conventions (moe-gemm keeps experts whole)
    with place.kernel_mesh("prefill", 1) as context:
        assert context.conventional and context.axes_of("experts") == ("model", "fsdp")
        assert context.axes_of("batch") == ("fsdp",)
    with place.kernel_mesh("train", 1) as context:
        assert context is None
    with pytest.raises(KernelInputError, match="splits its 6 experts over 4 chips"):
        place.weight("model.layers.0.mlp.experts.down_proj", (6, 2048, 768))
    all_model = placement("v5e", "2x2", 4, model)
    down = all_model.weight("model.layers.0.mlp.experts.down_proj", (8, 4, 2))
    assert tuple(down.spec) == ("model", None, None)  # fsdp 1: over model alone
    dense = type("Llama", (), {"_tp_plan": LLAMA_PLAN})()
    dense_place = placement("v5e", "2x2", 2, dense)
    assert "experts" not in dense_place.kernel_axis_rules("decode", 64)
    with dense_place.kernel_mesh("prefill", 1) as context:
        assert context is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology=2x2", "--tp=3", "--mode=train"], "--tp 3 must divide the 4 chips of 2x2"),
        (["--tp=2", "--mode=train"], "--tp 2 needs a multi-chip --topology"),
        (["--topology=2x2", "--mode=decode"], "--cache paged on a --topology: not built"),
    ],
)
def test_bad_mesh_input_is_refused_before_any_compile(args, message, capsys):
    assert main(["model-bench", "llama-3-70b", *args, "--tpu=v5e"]) == 2
    assert message in capsys.readouterr().err


# head_dim 128, 2 query and 2 KV heads (TP 2 splits both), widths divisible by both mesh axes
SHARDED_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "tie_word_embeddings": False,
}


@pytest.mark.tpu_compile
def test_a_sharded_training_step_compiles_per_chip(sharded_train):
    table, rows = sharded_train
    stock, kernelized = rows
    h, i, v = (SHARDED_LLAMA[k] for k in ("hidden_size", "intermediate_size", "vocab_size"))
    weights = 2 * (2 * (4 * h * h + 3 * h * i) + 2 * v * h)  # 2 compiled layers, bf16
    for row in rows:
        assert row["chips"] == 4 and row["tpu"] == "v5e"
        assert any("mesh fsdp 2 x model 2" in note for note in row["notes"])
        assert any(note.startswith("collectives") and "all-reduce" in note for note in row["notes"])
        # one chip holds about a quarter of the weights (whole, they are more than all of them)
        assert row["compiled"]["argument_bytes"] < weights / 3
    assert "v5e x4 (per" in table
    assert stock["kernels"] == [] and "flash_attention_forward" in kernelized["kernels"]
    # gradients come back placed like their parameters in both programs
    assert stock["compiled"]["output_bytes"] == kernelized["compiled"]["output_bytes"]
    assert kernelized["peak_hbm_bytes"] <= stock["peak_hbm_bytes"]


# Qwen3-MoE at tiny width: 4 heads of 128 (TP 2 splits them), 8 experts (EP over all 4 chips)
SHARDED_MOE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 3,
}


@pytest.mark.tpu_compile
def test_a_sharded_moe_decode_step_runs_the_experts_expert_parallel(sharded_moe_decode):
    """Qwen3-MoE's TP plan over ``model`` (2) and EP plan over ``model x fsdp`` (4) on a v5e 2x2:
    the kernelized step runs each chip's 2 experts (fused-moe, expert-parallel). Without the
    decode rule's ``experts`` entry (the negative control, run by hand) the boundary gathers
    every layer's experts: kernelized read 160 MB a chip against stock's 117 MB and this cell's
    77 MB. (Peak HBM is not compared at this width: kernelized holds 0.26 MB more temporaries
    of 18 MB.)"""
    _, rows = sharded_moe_decode
    stock, kernelized = rows
    for row in rows:
        assert row["chips"] == 4
        assert any(
            "mesh fsdp 2 x model 2" in n and "EP plan (experts) over model x fsdp" in n
            for n in row["notes"]
        )
    assert "fused_moe_experts" in kernelized["kernels"]
    assert kernelized["compiled"]["bytes_accessed"] < stock["compiled"]["bytes_accessed"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flux-1-dev", "--mode=train"], "--mode train is not one for flux-1-dev (diffusers)"),
        (["llama-3-8b", "--mode=denoise"], "--mode denoise is not one for llama-3-8b"),
        (["flux-1-dev", "--mode=denoise", "--image=1000"], "multiple of 16 pixels"),
        (["flux-1-dev", "--mode=denoise", "--topology=2x2"], "--topology with --mode denoise"),
    ],
)
def test_bad_diffusion_input_is_refused_before_any_compile(args, message, capsys):
    assert main(["model-bench", *args, "--tpu=v6e"]) == 2
    assert message in capsys.readouterr().err


def test_the_flux_preset_has_flux_1_dev_blocks():
    from kernel_hub.models.model_bench import spec_for_preset

    spec = spec_for_preset("flux-1-dev", mode="denoise", tpu="v6e")
    assert spec.full_layers == 57  # 19 double-stream + 38 single-stream blocks
    assert spec.plan() == (
        ["double_stream", "single_stream"],
        {
            "double_stream": ["double_stream", "single_stream", "double_stream"],
            "single_stream": ["double_stream", "single_stream", "single_stream"],
        },
    )


# Flux's layout at tiny width: head_dim 128 (the rope axes sum to it), 2 heads, 2 blocks of each
# type (1 of each in the base program), a 256 x 256 image (256 image tokens)
TINY_FLUX = {
    "num_layers": 2,
    "num_single_layers": 2,
    "num_attention_heads": 2,
    "joint_attention_dim": 256,
    "pooled_projection_dim": 64,
    "in_channels": 16,
}


@pytest.mark.tpu_compile
def test_a_flux_denoising_step_compiles_stock_and_kernelized(flux_denoise):
    _, rows = flux_denoise  # six compiles, about 50 s of CPU time
    stock, kernelized = rows
    for row in rows:
        assert (row["mode"], row["full_layers"], row["compiled_layers"]) == ("denoise", 4, 3)
        assert "(2 double_stream, 2 single_stream)" in row["notes"][0]
        assert any("256 image tokens + 512 text tokens" in note for note in row["notes"])
    assert stock["kernels"] == [] and stock["replaced"] == {}
    assert {"flash_attention_forward", "layer_norm_forward"} <= set(kernelized["kernels"])
    # the q/k RMSNorms are per head before the rotary: left to XLA (integrations.diffusers)
    assert "rms_norm_forward" not in kernelized["kernels"]
    assert kernelized["peak_hbm_bytes"] <= stock["peak_hbm_bytes"]


_KERNELIZE_TIED = """
from kernel_hub.models import model_bench as mb
spec = mb.spec_for_model_type("llama", mode="decode", tpu="v6e", cache="static", overrides={
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
    "num_key_value_heads": 1, "num_hidden_layers": 2, "tie_word_embeddings": True})
model = mb._build(spec, spec.layer_types())
before = len(dict(model.named_parameters()))
mb._kernelize(model, "decode")
tied = model.lm_head.weight is model.model.embed_tokens.weight
print(before == len(dict(model.named_parameters())), tied)
"""


def test_kernelizing_keeps_tied_embeddings_one_argument(kernelize_tied):
    """A tied LM head stays the embedding's tensor through the zero and meta swaps, so the traced
    kernelized step has one argument for both, as the stock one does (gemma-3-12b's kernelized
    decode held the 1.9 GiB embedding twice before)."""
    assert kernelize_tied[0].split()[-2:] == ["True", "True"]


# This module's cells (model_bench_cells.py), run in one subprocess: torchax renames torch's
# PrivateUse1 device for the rest of a process. Each with the packages it needs.
CELLS = {
    "sharded_train": (
        {
            "argv": [
                "model-bench",
                "--model-type=llama",
                *set_args(SHARDED_LLAMA),
                *("--mode=train", "--seq=128", "--batch=2"),
                *("--tpu=v5e", "--topology=2x2", "--tp=2"),
            ]
        },
        ("torchax", "libtpu"),
    ),
    "sharded_moe_decode": (
        {
            "argv": [
                "model-bench",
                "--model-type=qwen3_moe",
                *set_args(SHARDED_MOE),
                *("--mode=decode", "--batch=8", "--context=256", "--cache=static"),
                *("--tpu=v5e", "--topology=2x2", "--tp=2"),
            ]
        },
        ("torchax", "libtpu"),
    ),
    "flux_denoise": (
        {
            "argv": [
                "model-bench",
                "flux-1-dev",
                *set_args(TINY_FLUX),
                *("--mode=denoise", "--image=256", "--tpu=v6e"),
            ]
        },
        ("torchax", "libtpu", "diffusers"),
    ),
    "kernelize_tied": ({"code": _KERNELIZE_TIED, "argv": []}, ("torchax",)),
}


def _missing(name: str) -> list[str]:
    return [module for module in CELLS[name][1] if importlib.util.find_spec(module) is None]


@pytest.fixture(scope="module")
def bench_cells(request, tmp_path_factory) -> dict[str, dict]:
    """The cells of this module's selected tests whose packages are installed."""
    wanted = selected(request, lambda item: set(item.fixturenames) & set(CELLS))
    chosen = {name: CELLS[name][0] for name in sorted(wanted) if not _missing(name)}
    return run_cells(chosen, tmp_path_factory.mktemp("cells")) if chosen else {}


def _cell(bench_cells: dict[str, dict], name: str) -> tuple[str, list[dict] | None]:
    if missing := _missing(name):
        pytest.skip(f"this cell needs {', '.join(missing)} (the torchax, tpu and diffusers extras)")
    return ran(bench_cells, name)


@pytest.fixture
def sharded_train(bench_cells):
    return _cell(bench_cells, "sharded_train")


@pytest.fixture
def sharded_moe_decode(bench_cells):
    return _cell(bench_cells, "sharded_moe_decode")


@pytest.fixture
def flux_denoise(bench_cells):
    return _cell(bench_cells, "flux_denoise")


@pytest.fixture
def kernelize_tied(bench_cells):
    return _cell(bench_cells, "kernelize_tied")


def _decode_mlp(x, norm, w_gate, w_up, w_down, *, explicit_mesh=None):
    """A kernelized Llama decode step's MLP: RMSNorm, gate/up linears (TP column-wise over
    ``model``), the gated-MLP kernel, the down linear (row-wise), RMSNorm, weights FSDP over
    ``fsdp``. The kernels need whole features (gated-mlp's intermediate, the norms' hidden): on
    an Explicit mesh the caller gathers those activations; on an Auto mesh the partitioner
    chooses what to gather."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernel_hub import get_kernel

    rms = get_kernel("rmsnorm").jax.rms_norm
    act = get_kernel("gated-mlp").jax.gated_activation
    whole, placed = (lambda a: a), {}
    if explicit_mesh is not None:
        whole = lambda a: jax.sharding.reshard(a, NamedSharding(explicit_mesh, P()))
        placed = {"out_sharding": NamedSharding(explicit_mesh, P(None, None, "fsdp"))}
    h = rms(x, norm, 1e-6)
    gate, up = (whole(jnp.einsum("bsh,ih->bsi", h, w)) for w in (w_gate, w_up))
    down = jnp.einsum("bsi,hi->bsh", act(gate, up, "silu"), w_down, **placed)
    return rms(whole(down), norm, 1e-6)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_sharded_decode_step_keeps_fsdp_weights_in_place(kind):
    """model-bench's decode rules leave the norms' rows whole, so the linears between them keep
    their FSDP-split weights (the llama-3-70b decode row lost 4 GiB a chip to their gathers
    under the conventions, which split the rows over fsdp: the negative control). On an
    Explicit mesh the norms follow the arrays: rows whole there too."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("deviceless TPU compiles need libtpu")
    import contextlib
    import math
    import re

    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernel_hub.bench.compile_check import no_persistent_cache
    from kernel_hub.bench.mesh_compile import collective_shapes
    from kernel_hub.models.bench_sharding import MESH_AXES, Placement
    from kernel_hub.sharding import use_mesh
    from kernel_hub.topologies import filtered_libtpu_stderr, tpu_devices

    b, h, i = 16, 1024, 2048
    devices = tpu_devices("v5e")
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = Mesh(np.array(devices).reshape(2, 2), MESH_AXES, axis_types=(axis_type,) * 2)
    rows, norm = (None, None) if kind == "explicit" else ("fsdp", "fsdp")  # as model-bench
    specs = [P(rows), P(norm), P("model", "fsdp"), P("model", "fsdp"), P("fsdp", "model")]
    shapes = [(b, 1, h), (h,), (i, h), (i, h), (h, i)]
    args = [
        jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=NamedSharding(mesh, p))
        for s, p in zip(shapes, specs, strict=True)
    ]
    fn = _decode_mlp
    if kind == "explicit":
        fn = lambda *a: _decode_mlp(*a, explicit_mesh=mesh)
    weight_shard = i * h // mesh.shape["model"]  # a gate weight's TP shard, whole over fsdp

    def weight_gathers(rules):
        region = contextlib.nullcontext() if rules is None else use_mesh(mesh, rules)
        with (
            filtered_libtpu_stderr(),
            no_persistent_cache(),
            jax.default_device(devices[0]),
            region,
        ):
            # a new function each time: jit's trace cache does not key on use_mesh
            hlo = jax.jit(lambda *a: fn(*a)).trace(*args).lower().compile().as_text()
        assert "tpu_custom_call" in hlo  # the Pallas norm kernels, under their boundary
        sizes = [
            math.prod(int(d) for d in dims.split(",") if d)
            for op, shape in collective_shapes(hlo)
            if op == "all-gather"
            for dims in re.findall(r"\[([\d,]*)\]", shape)
        ]
        return sum(size >= weight_shard for size in sizes)

    rules = Placement(devices[0], mesh).kernel_axis_rules("decode", b)
    assert weight_gathers(rules) == 0
    if kind == "auto":
        assert weight_gathers(None) > 0  # the conventions split the rows: FSDP's gathers
    assert Placement(devices[0], mesh).kernel_axis_rules("train", b) is None


def _tp_mlp(x, w_gate, w_up, w_down, *, explicit_mesh=None):
    """Megatron's tensor-parallel MLP: gate/up column-wise (their outputs' intermediate
    features over ``model``), the gated-MLP kernel, down row-wise (a sum over ``model`` after
    it; an Explicit mesh asks for its placement)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernel_hub import get_kernel

    act = get_kernel("gated-mlp").jax.gated_activation
    placed = {}
    if explicit_mesh is not None:
        placed = {"out_sharding": NamedSharding(explicit_mesh, P("fsdp"))}
    gate, up = (jnp.einsum("bsh,ih->bsi", x, w) for w in (w_gate, w_up))
    return jnp.einsum("bsi,hi->bsh", act(gate, up, "silu"), w_down, **placed)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_tensor_parallel_mlp_keeps_its_intermediate_split(kind):
    """gated-mlp's rule lets separate gate and up arrays split their intermediate features, and
    the conventions split them over ``model``: between the column-wise gate/up and the row-wise
    down projection nothing is gathered (llama-3-70b's TP training step gathered them at
    version 1.1 of the kernel, which kept the features whole). The negative control keeps them
    whole (``use_mesh`` over the conventions) and gathers. On an Explicit mesh the kernel takes
    the split arrays as they are (version 1.1 refused them)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("deviceless TPU compiles need libtpu")
    import contextlib
    import math
    import re

    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernel_hub.bench.compile_check import no_persistent_cache
    from kernel_hub.bench.mesh_compile import collective_shapes
    from kernel_hub.models.bench_sharding import MESH_AXES
    from kernel_hub.sharding import use_mesh
    from kernel_hub.topologies import filtered_libtpu_stderr, tpu_devices

    b, s, h, i = 2, 256, 512, 1024
    devices = tpu_devices("v5e")
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = Mesh(np.array(devices).reshape(2, 2), MESH_AXES, axis_types=(axis_type,) * 2)
    specs = [P("fsdp"), P("model"), P("model"), P(None, "model")]
    shapes = [(b, s, h), (i, h), (i, h), (h, i)]
    args = [
        jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16, sharding=NamedSharding(mesh, spec))
        for shape, spec in zip(shapes, specs, strict=True)
    ]
    intermediate_shard = b * s * i // 4  # one chip's part of gate's [b, s, i] output
    explicit = {"explicit_mesh": mesh} if kind == "explicit" else {}

    def intermediate_gathers(rules):
        region = (
            contextlib.nullcontext()
            if rules is None
            else use_mesh(mesh, rules, over_conventions=True)
        )
        with (
            filtered_libtpu_stderr(),
            no_persistent_cache(),
            jax.default_device(devices[0]),
            region,
        ):
            # a new function each time: jit's trace cache does not key on use_mesh
            step = jax.jit(lambda *a: _tp_mlp(*a, **explicit))
            hlo = step.trace(*args).lower().compile().as_text()
        assert "tpu_custom_call" in hlo
        sizes = [
            math.prod(int(d) for d in dims.split(",") if d)
            for op, shape in collective_shapes(hlo)
            if op == "all-gather"
            for dims in re.findall(r"\[([\d,]*)\]", shape)
        ]
        return sum(size >= intermediate_shard for size in sizes)

    assert intermediate_gathers(None) == 0
    if kind == "auto":
        assert intermediate_gathers({"intermediate": None}) > 0
