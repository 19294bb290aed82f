"""Choosing benchmark cases, building their arguments, finding their implementation table."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_hub.bench.cases import (
    KernelCase,
    case_dtype,
    concrete_args,
    implementation_table,
    select_cases,
)
from kernel_hub.dispatch import Implementation, ImplementationTable
from kernel_hub.errors import KernelHubError, KernelInputError, UnknownNameError
from kernel_hub.kernel_api import KernelDeclaration


def gmm(x, group_sizes, *, implementation=None):
    return x


def make_case(name, dtype=jnp.float32, tags=(), **extra):
    args = (jax.ShapeDtypeStruct((8, 128), dtype),)
    return KernelCase(name=name, fn=gmm, args=args, tags=tags, **extra)


CASES = [
    make_case("decode-8", tags=("cpu",)),
    make_case("decode-8-bf16", jnp.bfloat16, tags=("cpu",)),
    make_case("prefill-4k", jnp.bfloat16),
]


def test_patterns_dtype_aliases_and_tags():
    assert [c.name for c in select_cases(CASES, ["decode-*"])] == ["decode-8", "decode-8-bf16"]
    assert [c.name for c in select_cases(CASES, dtype="bf16")] == ["decode-8-bf16", "prefill-4k"]
    assert [c.name for c in select_cases(CASES, tag="cpu", dtype="bfloat16")] == ["decode-8-bf16"]
    assert case_dtype(CASES[2]) == "bfloat16"


def test_filters_that_match_nothing_list_what_exists():
    with pytest.raises(UnknownNameError, match="decode-8, decode-8-bf16, prefill-4k"):
        select_cases(CASES, ["prefill-8k"])
    with pytest.raises(UnknownNameError, match="Valid dtypes: bfloat16, float32"):
        select_cases(CASES, dtype="f16")
    with pytest.raises(KernelHubError, match="repeated: decode-8"):
        select_cases([*CASES, make_case("decode-8")])


def test_floats_are_drawn_and_other_dtypes_need_make_args():
    (x,) = concrete_args(CASES[1])
    assert x.shape == (8, 128) and x.dtype == jnp.bfloat16 and np.std(x.astype(np.float32)) > 0.5
    grouped = KernelCase(
        name="grouped",
        fn=gmm,
        args=(jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)),
    )
    with pytest.raises(KernelInputError, match=r"argument 1 has dtype int32.*make_args"):
        concrete_args(grouped)
    sized = KernelCase(
        name="grouped",
        fn=gmm,
        args=grouped.args,
        make_args=lambda rng: (rng.standard_normal((8, 128)), np.array([3, 5], np.int32)),
    )
    assert concrete_args(sized)[1].tolist() == [3, 5]


def test_kernels_with_several_tables_name_the_op():
    def table(op):
        return ImplementationTable(op, [Implementation("xla", gmm, ("cpu",))], {"cpu": ("xla",)})

    declaration = KernelDeclaration(
        ops={"gmm": gmm}, jax=None, implementation_tables=(table("gmm"), table("tgmm"))
    )
    kernel = types.SimpleNamespace(KERNEL=declaration)
    assert implementation_table(kernel, CASES[0]).op == "gmm"  # by the function's name
    assert implementation_table(kernel, make_case("t", op="tgmm")).op == "tgmm"
    with pytest.raises(KernelHubError, match="tables are for: gmm, tgmm"):
        implementation_table(kernel, make_case("t", op="other"))
