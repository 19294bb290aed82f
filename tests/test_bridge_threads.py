"""kernel-hub ops called from 8 threads at once (as Transformers' continuous batching runs the
model in a background thread): correct results, no deadlock, in eager mode, under inference
mode, with gradients, and with the staging buffers in use."""

from __future__ import annotations

import threading

import pytest
import torch
from staging_helpers import record_stagings

from kernel_hub.bridge.runtimes import staging
from kernel_hub.loading.resolver import get_kernel

THREADS = 8
CALLS = 40
JOIN_TIMEOUT_S = 180  # a deadlock shows as threads still alive after this


@pytest.fixture(scope="module")
def ops():
    return get_kernel("rmsnorm", source="local"), get_kernel("attention", source="local")


@pytest.fixture
def stagings(monkeypatch):
    """Every InputStaging the DLPack runtime makes while the test runs."""
    return record_stagings(monkeypatch)


def rms_reference(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention_reference(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def run_threads(work) -> list[str]:
    """``work(index, barrier)`` in 8 threads released together; their errors, or a deadlock."""
    barrier = threading.Barrier(THREADS)
    errors: list[str] = []

    def target(index: int) -> None:
        try:
            work(index, barrier)
        except Exception as exc:  # reported below with the thread's index
            errors.append(f"thread {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    alive = sum(thread.is_alive() for thread in threads)
    return errors + ([f"{alive} threads still running: deadlock"] if alive else [])


@pytest.mark.parametrize("mode", ["eager", "inference_mode"])
def test_eight_threads_first_calls_and_staged_calls_are_correct(ops, stagings, mode):
    rmsnorm, attention = ops
    # new shapes for this test: all 8 threads build the plans and compile at once
    shapes = {"eager": (3, 48), "inference_mode": (5, 80)}[mode]
    weight = torch.rand(shapes[1]) + 0.5
    big_rows = staging.MAX_STAGED_BYTES // (shapes[1] * 4) + 1  # over the staging limit

    def work(index: int, barrier: threading.Barrier) -> None:
        generator = torch.Generator().manual_seed(index)
        context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with context:
            barrier.wait()
            for call in range(CALLS):
                rows = big_rows if call % 10 == 9 else shapes[0]  # staged and imported inputs
                x = torch.randn(rows, shapes[1], generator=generator)
                out = rmsnorm.rms_norm(x, weight)
                torch.testing.assert_close(out, rms_reference(x, weight), rtol=1e-5, atol=1e-5)
                if call % 8 == 0:
                    q, k, v = (torch.randn(1, 2, 8, 16, generator=generator) for _ in range(3))
                    got = attention.dot_product_attention(q, k, v, causal=True)
                    want = attention_reference(q, k, v)
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    assert run_threads(work) == []
    # the test plugin applies the inline policy before collection, so staging applies here
    assert staging.synchronous_cpu_dispatch()
    assert any(s.enabled and s.staged_positions for s in stagings)


def test_eight_threads_gradients_are_correct(ops):
    rmsnorm, _ = ops

    def work(index: int, barrier: threading.Barrier) -> None:
        generator = torch.Generator().manual_seed(100 + index)
        barrier.wait()
        for _ in range(10):
            x = torch.randn(4, 32, generator=generator, requires_grad=True)
            weight = (torch.rand(32, generator=generator) + 0.5).requires_grad_()
            grads = torch.autograd.grad(rmsnorm.rms_norm(x, weight).square().sum(), [x, weight])
            x_ref, w_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
            expected = torch.autograd.grad(
                rms_reference(x_ref, w_ref).square().sum(), [x_ref, w_ref]
            )
            for got, want in zip(grads, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    assert run_threads(work) == []
