"""Optimizers. Each is defined once: its hyperparameters, its per-parameter state and the WGSL of
its update, which `kernels/optimizer.py` turns into one kernel per parameter.

Hyperparameters live in a small GPU buffer rather than in the kernel text, so changing the
learning rate (`session.set_hyperparams(lr=...)`) needs no recompilation or re-recording. The step
count `t` lives there too and is advanced on the GPU, once per step, before the updates.
The arithmetic follows torch.optim term by term, so the two agree to rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class Optimizer:
    state_names: tuple[str, ...] = ()

    def hyperparams(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}  # type: ignore[call-overload]

    def update(self) -> str:
        """WGSL statements updating `p` (var) from `g` (var, the gradient), the step count `t`,
        the hyperparameters by name and `var` state variables named as in `state_names`."""
        raise NotImplementedError


@dataclass
class SGD(Optimizer):
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def update(self) -> str:
        lines = ["g = g + weight_decay * p;"] if self.weight_decay else []
        if self.momentum:
            # torch starts the buffer at the first gradient, undamped
            lines += ["momentum_buffer = select(momentum * momentum_buffer + (1.0 - dampening) * g,"
                      " g, t == 1.0);",
                      "g = g + momentum * momentum_buffer;" if self.nesterov
                      else "g = momentum_buffer;"]
        return "\n".join(lines + ["p = p - lr * g;"])


@dataclass
class Adam(Optimizer):
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def update(self) -> str:
        decay = ("p = p * (1.0 - lr * weight_decay);" if self.decoupled
                 else "g = g + weight_decay * p;")
        return "\n".join([
            decay if self.weight_decay else "",
            "exp_avg = exp_avg + (1.0 - beta1) * (g - exp_avg);",
            "exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * g * g;",
            "let bias1 = 1.0 - pow(beta1, t);",
            "let bias2 = 1.0 - pow(beta2, t);",
            "let denom = sqrt(exp_avg_sq) / sqrt(bias2) + eps;",
            "p = p - (lr / bias1) * exp_avg / denom;",
        ])


@dataclass
class AdamW(Adam):
    """Adam with decoupled weight decay (torch.optim.AdamW; its default decay is 0.01)."""

    weight_decay: float = 1e-2
    decoupled = True
