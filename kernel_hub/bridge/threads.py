"""Thread policy for JAX computations run from inside torch ops on CPU.

By default JAX hands every CPU computation to a worker thread of its own and the caller waits for
it. From inside a torch op that costs a thread handoff per call (~40 us here), and on a machine
with few cores the worker competes with torch's OpenMP threads, which spin after each parallel
region. The ``"inline"`` policy (the default) makes JAX run CPU computations on the calling
thread instead (``jax_cpu_enable_async_dispatch=False``). torch's own threads are left alone, so
torch code is never slowed.

The setting only takes effect if JAX's CPU backend has not started yet; kernel-hub applies it
lazily, when it first runs a JAX computation, never at import. ``KERNEL_HUB_THREADS=default``
(or ``set_thread_policy("default")`` before the first call) keeps JAX's own behaviour.
"""

from __future__ import annotations

import logging
import os

from kernel_hub.errors import UnknownNameError

log = logging.getLogger(__name__)

ENV = "KERNEL_HUB_THREADS"
POLICIES = ("inline", "default")

_policy: str | None = None  # set_thread_policy() value; None: read the environment
_applied = False


def set_thread_policy(policy: str) -> None:
    """Choose the policy (``"inline"`` or ``"default"``) before kernel-hub's first JAX call."""
    if policy not in POLICIES:
        raise UnknownNameError("thread policy", policy, POLICIES)
    global _policy
    _policy = policy


def thread_policy() -> str:
    """The policy in force: ``set_thread_policy()``'s, else ``$KERNEL_HUB_THREADS``, else inline."""
    if _policy is not None:
        return _policy
    policy = os.environ.get(ENV, "inline").strip().lower()
    if policy not in POLICIES:
        raise UnknownNameError(f"thread policy of ${ENV}", policy, POLICIES)
    return policy


def apply_default_policy() -> None:
    """Apply the policy once per process, before kernel-hub starts JAX's CPU backend."""
    global _applied
    if _applied:
        return
    _applied = True
    if thread_policy() != "inline":
        return
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.config.read("jax_cpu_enable_async_dispatch"):
            log.info(
                "kernel-hub: JAX's backends started before kernel-hub's first call; CPU "
                "computations keep JAX's async dispatch (slower from inside torch ops)"
            )
        return
    jax.config.update("jax_cpu_enable_async_dispatch", False)
