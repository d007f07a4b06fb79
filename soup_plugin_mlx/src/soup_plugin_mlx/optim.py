"""The optimizer of the mlx backend: AdamW and gradient clipping exactly as torch and the Hugging Face
Trainer do them (bias correction; no decay for biases and norm weights; clip by the global norm)."""

from __future__ import annotations

import math

import mlx.core as mx

from soup_plugin_mlx.errors import MLXBackendError

_NO_DECAY = ("bias", "layernorm", "rmsnorm")


def decays(name: str) -> bool:
    """Whether AdamW decays parameter ``name`` — the Trainer's rule: not biases, not norm weights."""
    lowered = name.lower()
    if any(word in lowered for word in _NO_DECAY):
        return False
    parts = lowered.split(".")
    return not any(part == "norm" or part.endswith("_norm") for part in parts)


class AdamW:
    """torch.optim.AdamW's update on a flat dict of parameters (decay only where :func:`decays`).

    ``state`` (the moments) is a tree updated in place, so a compiled update can declare it as state.
    The step count and learning rate stay in Python; :meth:`scalars` turns them into the arrays the
    update takes, so one compiled graph serves every step.
    """

    def __init__(
        self,
        params: dict[str, mx.array],
        *,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.weight_decay, self.betas, self.eps = float(weight_decay), betas, eps
        self.step = 0
        self.state: dict[str, dict[str, mx.array]] = {
            "m": {k: mx.zeros_like(v) for k, v in params.items()},
            "v": {k: mx.zeros_like(v) for k, v in params.items()},
        }
        self.decay = {k: self.weight_decay > 0 and decays(k) for k in params}

    def scalars(self, lr: float) -> tuple[mx.array, mx.array, mx.array]:
        """Advance the step count; (learning rate, lr / (1 - b1^t), sqrt(1 - b2^t)) as arrays."""
        self.step += 1
        b1, b2 = self.betas
        return (
            mx.array(lr, dtype=mx.float32),
            mx.array(lr / (1 - b1**self.step), dtype=mx.float32),
            mx.array(math.sqrt(1 - b2**self.step), dtype=mx.float32),
        )

    def apply(
        self,
        params: dict[str, mx.array],
        grads: dict[str, mx.array],
        lr: mx.array,
        step_size: mx.array,
        bc2_sqrt: mx.array,
    ) -> dict[str, mx.array]:
        b1, b2 = self.betas
        m_state, v_state = self.state["m"], self.state["v"]
        new: dict[str, mx.array] = {}
        for name, grad in grads.items():
            param = params[name]
            if self.decay[name]:
                param = param * (1 - lr * self.weight_decay).astype(param.dtype)
            m = b1 * m_state[name] + (1 - b1) * grad
            v = b2 * v_state[name] + (1 - b2) * mx.square(grad)
            m_state[name], v_state[name] = m, v
            update = step_size * m / (mx.sqrt(v) / bc2_sqrt + self.eps)
            new[name] = param - update.astype(param.dtype)
        return new

    def state_arrays(self) -> dict[str, mx.array]:
        out = {f"m.{k}": v for k, v in self.state["m"].items()}
        out.update({f"v.{k}": v for k, v in self.state["v"].items()})
        out["step"] = mx.array(self.step)
        return out

    def load_state(self, arrays: dict[str, mx.array]) -> None:
        for moment in ("m", "v"):
            for name, current in self.state[moment].items():
                if f"{moment}.{name}" not in arrays:
                    raise MLXBackendError(f"the checkpoint's optimizer state has no entry for {name}")
                self.state[moment][name] = arrays[f"{moment}.{name}"].astype(current.dtype)
        self.step = int(arrays["step"].item())


def clip_by_global_norm(grads: dict[str, mx.array], max_norm: float) -> tuple[dict[str, mx.array], mx.array]:
    """torch's ``clip_grad_norm_``: scale by ``max_norm / (norm + 1e-6)`` when that is below 1."""
    total = mx.sqrt(sum(mx.sum(mx.square(g.astype(mx.float32))) for g in grads.values()))
    if max_norm <= 0:
        return grads, total
    coef = mx.minimum(max_norm / (total + 1e-6), 1.0)
    return {k: (g * coef).astype(g.dtype) for k, g in grads.items()}, total
