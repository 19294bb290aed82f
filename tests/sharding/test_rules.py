"""Sharding rules and their solver without devices: what each rule allows, refuses and why, and
the DTensor strategies derived from it."""

from __future__ import annotations

import pytest

from kernel_hub.sharding import ShardingError, ShardingRule
from kernel_hub.sharding.dtensor import backward_strategies, forward_strategies
from kernel_hub.sharding.solve import Operand, solve

NORM = ShardingRule.parse("norm", "... d, d -> ... d", whole=("d",))
GQA = ShardingRule.parse(
    "attn",
    "b h s e, b g s e -> b h s e",
    whole=("s", "e"),
    together=(("h", "g"),),
    handled_by={"s": "the ring layer"},
)
MATMUL = ShardingRule.parse("mm", "m k, k n -> m n", reduced=("k",))
SIZES = {"data": 2, "model": 4}


def test_rows_split_and_weight_follows() -> None:
    x = Operand("x", (4, 8, 16), (("data",), ("model",), ()))
    w = Operand("w", (16,), ((),))
    solution = solve(NORM, [x, w], SIZES)
    assert solution.operands == ((("data",), ("model",), ()), ((),))
    assert solution.results == ((("data",), ("model",), ()),)
    assert solution.result_reductions == ((),)


def test_whole_factor_names_operand_axis_and_layer() -> None:
    q = Operand("q", (2, 8, 64, 32), ((), (), ("data",), ()))
    k = Operand("k", (2, 4, 64, 32), ((), (), (), ()))
    with pytest.raises(ShardingError, match=r"q dimension 2 .*'data'.*'s' must stay whole.*ring"):
        solve(GQA, [q, k], SIZES)


def test_grouped_heads_follow_and_must_divide() -> None:
    q = Operand("q", (2, 8, 64, 32), ((), ("model",), (), ()))
    k = Operand("k", (2, 4, 64, 32), ((), (), (), ()))
    assert solve(GQA, [q, k], SIZES).operands[1][1] == ("model",)
    narrow = Operand("k", (2, 2, 64, 32), ((), (), (), ()))
    with pytest.raises(ShardingError, match=r"k dimension 1 .* divisible by 4"):
        solve(GQA, [q, narrow], SIZES)


def test_conflicting_axes_are_refused() -> None:
    a = Operand("a", (8, 16), (("data",), ()))
    b = Operand("b", (16, 4), (("model",), ()))
    with pytest.raises(ShardingError, match="factor 'k'"):
        solve(MATMUL, [Operand("a", (8, 16), ((), ("data",))), b], SIZES)
    with pytest.raises(ShardingError, match="one mesh axis may split one factor"):
        solve(MATMUL, [a, Operand("b", (16, 4), ((), ("data",)))], SIZES)


def test_reduced_factor_sums_over_its_axes() -> None:
    a = Operand("a", (8, 16), ((), ("data",)))
    b = Operand("b", (16, 4), (("data",), ()))
    assert solve(MATMUL, [a, b], SIZES).result_reductions == (("data",),)


def test_result_without_a_split_factor_is_summed_over_its_axes() -> None:
    """Einsum-style: the sinks' gradient ("h") lacks batch, which dq keeps: summed over data."""
    rule = ShardingRule.parse("grad", "b h s, h -> b h s, h")
    q = Operand("q", (4, 8, 16), (("data",), ("model",), ()))
    sinks = Operand("sinks", (8,), (("model",),))
    solution = solve(rule, [q, sinks], SIZES)
    assert solution.results == ((("data",), ("model",), ()), (("model",),))
    assert solution.result_reductions == ((), ("data",))


LOSS = ShardingRule.parse(
    "loss", "t d, v d, t -> t, t", whole=("d",), combined=("v",)
)  # hidden, head, labels -> per-token statistics


def test_combined_factor_is_split_but_never_summed() -> None:
    """The function combines a ``combined`` factor's shards itself (``split_axes``): its results
    are not summed by the boundary, and DTensor never splits it."""
    from torch.distributed.tensor import Replicate, Shard

    h = Operand("h", (8, 16), (("data",), ()))
    w = Operand("w", (32, 16), (("model",), ()))
    labels = Operand("labels", (8,), ((),))
    solution = solve(LOSS, [h, w, labels], SIZES)
    assert solution.operands[2] == (("data",),)
    assert solution.results == ((("data",),), (("data",),))
    assert solution.result_reductions == ((), ())
    assert solution.split_axes(LOSS) == {"v": ("model",)}
    assert solve(MATMUL, [h, Operand("b", (16, 4), ((), ()))], SIZES).split_axes(MATMUL) == {}
    strategies = forward_strategies(LOSS, [2, 2, 1])
    assert ([Shard(0), Shard(0)], [Shard(0), Replicate(), Shard(0)]) in strategies
    assert all(inputs[1] == Replicate() for _, inputs in strategies)


def test_located_factor_is_told_to_the_function_and_never_split_by_dtensor() -> None:
    """A ``located`` factor splits like a free one, and the function is told its axes
    (``split_axes``, for its shard's global offset); DTensor never splits it."""
    from torch.distributed.tensor import Replicate

    rule = ShardingRule.parse(
        "drop", "b h s e, b g s e -> b h s e", whole=("s", "e"), together=(("h", "g"),),
        located=("b", "h"),
    )  # fmt: skip
    q = Operand("q", (2, 8, 64, 32), (("data",), ("model",), (), ()))
    k = Operand("k", (2, 4, 64, 32), ((), (), (), ()))
    solution = solve(rule, [q, k], SIZES)
    assert solution.results == ((("data",), ("model",), (), ()),)
    assert solution.split_axes(rule) == {"b": ("data",), "h": ("model",)}
    strategies = forward_strategies(rule, [4, 4])
    assert all(inputs == [Replicate(), Replicate()] for _, inputs in strategies), strategies


def test_optional_operand_and_rank_errors() -> None:
    rule = ShardingRule.parse("f", "b s, b s -> b s")
    x = Operand("x", (4, 2), (("data",), ()))
    assert solve(rule, [x, None], SIZES).operands == ((("data",), ()),)
    with pytest.raises(ShardingError, match=r"x has rank 3; .* reads it as \[b s\]"):
        solve(rule, [Operand("x", (4, 2, 1), ((), (), ())), None], SIZES)


def test_choose_rule_gives_ranks_only_to_sources_that_take_them() -> None:
    from kernel_hub.sharding.boundary import choose_rule

    by_layout = lambda transpose=False, **options: ShardingRule.parse(
        "f", "a b -> b" if transpose else "a b -> a", whole=("a", "b")
    )
    by_rank = lambda ranks=(), **options: ShardingRule.parse(
        "f",
        "a b, a b c -> a" if ranks[1] == 3 else "a b, a b -> a",
        whole=("b",),
        reduced=("c",) if ranks[1] == 3 else (),
    )
    assert choose_rule(NORM, {"eps": 1e-6}, [3, 1]) is NORM
    assert choose_rule(by_layout, {"transpose": True}, [2]).results == (("b",),)
    assert choose_rule(by_rank, {}, [2, 3]).operands[1] == ("a", "b", "c")
    assert choose_rule(by_rank, {}, [2, 2, None]).operands[1] == ("a", "b")


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        ("a b -> a", {}, "factor 'b' is in no result"),
        ("a -> a", {"whole": ("z",)}, r"factors \['z'\] are in no operand"),
        ("a b -> a b", {"reduced": ("b",)}, "appear in results"),
        ("a b -> a b", {"combined": ("b",)}, r"combined factors \['b'\] appear in results"),
        ("a ... -> a", {}, "'...' may appear once, first"),
        ("a, a", {}, "'operands -> results'"),
    ],
)
def test_malformed_rules(text, options, message) -> None:
    with pytest.raises(ShardingError, match=message):
        ShardingRule.parse("bad", text, **options)


def test_dtensor_forward_strategies() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    norm = forward_strategies(NORM, [3, 1])
    assert norm[0] == ([Replicate()], [Replicate(), Replicate()])
    assert ([Shard(1)], [Shard(1), Replicate()]) in norm
    assert all(Shard(2) not in outs for outs, _ in norm)  # hidden stays whole
    assert ([Partial()], [Shard(1), Shard(0)]) in forward_strategies(MATMUL, [2, 2])
    gqa = forward_strategies(GQA, [4, 4])
    assert ([Shard(1)], [Shard(1), Shard(1)]) in gqa  # heads with kv heads, once


def test_dtensor_backward_gives_partial_weight_gradients() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    rows = backward_strategies(NORM, [3, 1], differentiable=[0, 1])
    assert ([Shard(0), Partial()], [Shard(0), Replicate(), Shard(0), Shard(0)]) in rows
    matmul = backward_strategies(MATMUL, [2, 2], differentiable=[0, 1])
    assert ([Shard(0), Partial()], [Shard(0), Replicate(), Shard(0), Shard(0)]) in matmul
    assert all(inputs[0] != Shard(1) for _, inputs in matmul)  # the reduced k is not offered


MASKED = ShardingRule.parse(
    "masked", "b h s, b? h? s, b? h? s -> b h s, b? h? s", whole=("s",)
)  # q, mask, bias -> out, d_bias


def test_broadcast_dimension_stays_whole_and_its_gradient_is_summed() -> None:
    q = Operand("q", (4, 8, 16), (("data",), ("model",), ()))
    mask = Operand("mask", (1, 8, 16), ((), (), ()))
    bias = Operand("bias", (4, 1, 16), ((), (), ()))
    solution = solve(MASKED, [q, mask, bias], SIZES, [(4, 8, 16), (4, 1, 16)])
    assert solution.operands[1:] == (((), ("model",), ()), (("data",), (), ()))
    assert solution.results[1] == (("data",), (), ())
    assert solution.result_reductions == ((), ("model",))  # d_bias summed over the heads' axis
    full = solve(MASKED, [q, mask, Operand("bias", (4, 8, 16), ((), (), ()))], SIZES, None)
    assert full.results[1] == (("data",), ("model",), ()) and full.result_reductions == ((), ())
    assert str(MASKED) == "b h s, b? h? s, b? h? s -> b h s, b? h? s"


def test_dtensor_replicates_a_broadcast_operand_and_sums_its_gradient() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    shapes = [(4, 8, 16), (1, 8, 16), (4, 8, 16)]  # the mask broadcasts over b
    strategies = forward_strategies(MASKED, [3, 3, 3], shapes)
    assert ([Shard(0), Shard(0)], [Shard(0), Replicate(), Shard(0)]) in strategies
    assert ([Shard(1), Shard(1)], [Shard(1), Shard(1), Shard(1)]) in strategies
    backward = backward_strategies(MASKED, [3, 3, 3], [0, 1, 2], shapes)
    grads = [g for g, inputs in backward if inputs[0] == Shard(0)]
    assert grads == [[Shard(0), Partial(), Shard(0)]]  # the mask's gradient: a partial sum


def test_conventional_placement_on_auto_meshes() -> None:
    """Auto meshes under plain jit: factors placed by the mesh-axis names; a placement a
    dimension cannot divide is dropped with its grouped partner (a guess, not a request)."""
    from types import SimpleNamespace

    from kernel_hub.sharding.boundary import _divisible
    from kernel_hub.sharding.context import conventional_context

    mesh = SimpleNamespace(axis_names=("data", "model", "cp"), axis_sizes=(2, 4, 2))
    context = conventional_context(mesh)
    assert context.axes_of("batch") == ("data",) and context.axes_of("...0") == ("data",)
    assert context.axes_of("heads") == context.axes_of("kv_heads") == ("model",)
    assert context.axes_of("channels") == context.axes_of("vocab") == ("model",)
    assert context.axes_of("...1") == () and context.axes_of("q_len") == ()
    q = Operand("q", (2, 8, 64, 32), (("data",), ("model",), (), ()))
    narrow_k = Operand("k", (2, 2, 64, 32), (("data",), ("model",), (), ()))
    placed = _divisible(GQA, [q, narrow_k], mesh)
    assert [o.axes[:2] for o in placed] == [(("data",), ()), (("data",), ())]
    # a size-1 broadcasting dimension (rotary's batch-shared tables) is unsplit itself and
    # leaves the factor split elsewhere; one of another size that cannot divide still drops it
    rope = ShardingRule.parse("rope", "batch heads s d, batch? s d -> batch heads s d")
    table = Operand("cos", (1, 64, 32), (("data",), (), ()))
    placed = _divisible(rope, [q, table], mesh)
    assert [o.axes[0] for o in placed] == [("data",), ()]
    odd = Operand("cos", (3, 64, 32), (("data",), (), ()))
    assert [o.axes[0] for o in _divisible(rope, [q, odd], mesh)] == [(), ()]


def test_rules_over_the_conventions_add_to_them_and_stay_lenient() -> None:
    """``use_mesh(..., over_conventions=True)``: the conventions of an Auto mesh plus (or
    overridden by) the given rules, still conventional (an indivisible placement is dropped, not
    an error); without it the rules alone, strict."""
    from types import SimpleNamespace

    from kernel_hub.sharding import use_mesh

    mesh = SimpleNamespace(axis_names=("fsdp", "model"), axis_sizes=(2, 4))
    rules = {"experts": ("model", "fsdp"), "heads": None}
    with use_mesh(mesh, rules, over_conventions=True) as context:
        assert context.conventional
        assert context.axes_of("experts") == ("model", "fsdp")
        assert context.axes_of("heads") == ()  # overridden
        assert context.axes_of("batch") == ("fsdp",) and context.axes_of("kv_heads") == ("model",)
    with use_mesh(mesh, rules) as context:
        assert not context.conventional
        assert context.axes_of("experts") == ("model", "fsdp") and context.axes_of("batch") == ()


def test_gated_activation_splits_separate_features_and_keeps_fused_ones_whole() -> None:
    """gated-mlp's rule by layout: separate gate and up (Megatron's column-split TP) may split
    their intermediate features, a fused gate_up may not (a split would part gate columns from
    their up columns); both with ``up`` as the second tensor, present or not, as the DTensor
    strategies see the op's tensors."""
    from torch.distributed.tensor import Shard

    from kernel_hub import get_kernel
    from kernel_hub.sharding.boundary import choose_rule, rule_of

    rule = rule_of(get_kernel("gated-mlp").jax.gated_activation)
    separate, fused = choose_rule(rule, {}, [3, 3]), choose_rule(rule, {}, [3, None])
    split_last = ([Shard(2)], [Shard(2), Shard(2)])
    assert split_last in forward_strategies(separate, [3, 3], [(2, 4, 8), (2, 4, 8)])
    fused_strategies = forward_strategies(fused, [3, None], [(2, 4, 16), None])
    assert fused_strategies and all(Shard(2) not in out for out, _ in fused_strategies)
