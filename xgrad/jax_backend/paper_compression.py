"""The compression experiment's JAX run: the same MLP training as the torch ranks, on 2
CPU devices with xgrad's fp16/bf16 and PowerSGD hooks.

Called by :mod:`xgrad.experiments.compression` through the registry
(``get_backend("jax").compression_runs``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad
from xgrad.powersgd import PowerSGD

__all__ = ["compression_runs"]


def compression_runs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same training in JAX on 2 CPU devices (fresh process state needs the flag)."""
    start_iter, lr = cfg["start"], cfg["lr"]
    names = list(cfg["weights"])
    n_layers = sum(1 for k in names if k.endswith("weight"))

    def loss_fn(params: dict[str, Any], x: Any, y: Any) -> Any:
        for i in range(n_layers):
            x = x @ params[f"layers.{i}.weight"].T + params[f"layers.{i}.bias"]
            x = jnp.tanh(x) if i < n_layers - 1 else x
        return jnp.mean((x - y) ** 2)

    x, y = (jnp.asarray(a) for a in cfg["batch"])
    out = {}
    exact_step = data_parallel_value_and_grad(loss_fn, world_size=2)
    for name, r in cfg["variants"].items():
        hook: Any = None
        if name in ("fp16", "bf16"):
            hook = name
        elif r:
            hook = PowerSGD(
                matrix_approximation_rank=r,
                start_powerSGD_iter=start_iter,
                min_compression_rate=cfg["min_rate"],
                random_seed=cfg["seed"],
            )
        step_fn = data_parallel_value_and_grad(loss_fn, world_size=2, hook=hook)
        params = {k: jnp.asarray(v) for k, v in cfg["weights"].items()}
        state = step_fn.init(params) if step_fn.stateful else None
        losses, error = [], 0.0
        for step in range(cfg["steps"]):
            if state is None:
                loss, grads = step_fn(params, x, y)
            else:
                loss, grads, state = step_fn(params, x, y, hook_state=state)
            if step == start_iter:
                _, exact = exact_step(params, x, y)
                e = jnp.concatenate([exact[k].reshape(-1) for k in names])
                g = jnp.concatenate([grads[k].reshape(-1) for k in names])
                error = float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
            losses.append(float(loss))
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        out[name] = {"losses": losses, "error": error}
    return out
