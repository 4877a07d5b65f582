"""Optimizers. Each is defined once: its hyperparameters, its per-parameter state and the WGSL of
its update, which `kernels/optimizer.py` turns into one kernel per parameter.

Hyperparameters live in a small GPU buffer rather than in the kernel text, so changing the
learning rate (`session.set_hyperparams(lr=...)`) needs no recompilation or re-recording. The step
count `t` lives there too and is advanced on the GPU, once per step, before the updates.
The arithmetic follows torch.optim term by term, so the two agree to rounding; where torch computes
a term on the host in float64 (Adam's bias corrections), vkml computes it on the host too, into a
table the update reads by step count (`tables()`). The constructors take torch.optim's keywords
too (`Adam(lr=..., betas=(0.9, 0.999), eps=..., weight_decay=...)`, SGD's as torch.optim.SGD's),
so a training script moves over unchanged.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, asdict, dataclass

import numpy as np

from vkml.errors import InputError

# Steps whose bias corrections come from the float64 table; later ones are computed on the GPU as
# 1 - exp(t * log(beta)), log(beta) from the host's float64 (the table's last row): by then
# 1 - beta^t is far enough from 0 that f32's exp error stays below 3e-6. pow(beta, t) of the f32
# beta instead was 5e-5 off at beta2 = 0.9999 and 7e-3 at 0.999999: f32(beta)'s own rounding,
# raised to the t-th power.
BIAS_TABLE_STEPS = 8192
# Where the table's last row (log(beta1), log(beta2)) starts.
LOG_BETAS = 2 * (BIAS_TABLE_STEPS + 1)


class Optimizer:
    state_names: tuple[str, ...] = ()

    def hyperparams(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}  # type: ignore[call-overload]

    def tables(self, hyperparams: dict[str, float]) -> dict[str, np.ndarray]:
        """Constant f32 arrays the update reads (by name), computed on the host from the
        hyperparameters; rebuilt when set_hyperparams changes them."""
        return {}

    # Hyperparameters the compiled update's code depends on: set_hyperparams cannot change them.
    fixed: tuple[str, ...] = ()

    def check(self, values: dict[str, float]) -> None:
        """Raise InputError for values torch.optim would refuse (and for NaN, inf, None)."""
        kind = type(self).__name__
        for name, value in values.items():
            if isinstance(value, bool):  # a switch (nesterov), not a number
                continue
            if not isinstance(value, (int, float, np.floating, np.integer)):
                raise InputError(f"{kind}: {name} must be a number, got {value!r}")
            if not np.isfinite(value):
                raise InputError(f"{kind}: {name} must be finite, got {value}")
            if name in self.ranges:
                low, high = self.ranges[name]
                if not low <= value < high:
                    limit = "" if high == float("inf") else f" and below {high:g}"
                    raise InputError(f"{kind}: {name}={value} must be at least {low:g}{limit}")

    # name -> [lowest, highest) allowed: torch.optim's checks
    ranges: dict[str, tuple[float, float]] = {}

    def __post_init__(self) -> None:
        self.check(asdict(self))  # type: ignore[call-overload]

    def update(self) -> str:
        """WGSL statements updating `p` (var) from `g` (var, the gradient), the step count `t`,
        the hyperparameters by name and `var` state variables named as in `state_names`."""
        raise NotImplementedError


def _torch_only(optimizer: str, **flags: bool | None) -> None:
    """torch.optim's options that change the arithmetic, which vkml does not implement: refuse
    them when set rather than train something else. (Its implementation choices, `foreach`,
    `fused`, `capturable` and `differentiable`, change nothing here: every update is one
    fused kernel per parameter anyway; they are accepted and ignored.)"""
    hints = {"decoupled_weight_decay": "use vkml.AdamW, which is Adam with decoupled decay"}
    for name, value in flags.items():
        if value:
            raise InputError(f"{optimizer}({name}={value!r}): vkml's {optimizer} does not "
                             f"implement {name}; " + hints.get(name, f"leave {name}=False"))


@dataclass
class SGD(Optimizer):
    """torch.optim.SGD, with its defaults and keywords."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    _: KW_ONLY
    maximize: InitVar[bool] = False
    foreach: InitVar[bool | None] = None
    differentiable: InitVar[bool] = False
    fused: InitVar[bool | None] = None

    ranges = {"lr": (0.0, float("inf")), "momentum": (0.0, float("inf")),
              "weight_decay": (0.0, float("inf"))}

    def __post_init__(self, maximize: bool = False, foreach: bool | None = None,  # type: ignore[override]
                      differentiable: bool = False, fused: bool | None = None) -> None:
        _torch_only(type(self).__name__, maximize=maximize)
        super().__post_init__()
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InputError("SGD: nesterov momentum requires a momentum and zero dampening")

    @property
    def fixed(self) -> tuple[str, ...]:  # type: ignore[override]
        # The momentum buffer exists only when compiled with momentum; nesterov picks the code.
        return ("nesterov",) if self.momentum else ("momentum", "nesterov")

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def update(self) -> str:
        # Always applied (0 changes nothing), so set_hyperparams(weight_decay=...) takes effect.
        lines = ["g = g + weight_decay * p;"]
        if self.momentum:
            # torch starts the buffer at the first gradient, undamped, and leaves it alone while
            # momentum is 0 (set_hyperparams can set it so)
            lines += ["if (momentum != 0.0) {",
                      "  momentum_buffer = select(momentum * momentum_buffer"
                      " + (1.0 - dampening) * g, g, t == 1.0);",
                      "  g = g + momentum * momentum_buffer;" if self.nesterov
                      else "  g = momentum_buffer;", "}"]
        return "\n".join(lines + ["p = p - lr * g;"])


@dataclass
class Adam(Optimizer):
    """torch.optim.Adam: `betas=(beta1, beta2)` as torch spells it, or `beta1=`, `beta2=`."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    _: KW_ONLY
    betas: InitVar[tuple[float, float] | None] = None
    amsgrad: InitVar[bool] = False
    maximize: InitVar[bool] = False
    foreach: InitVar[bool | None] = None
    capturable: InitVar[bool] = False
    differentiable: InitVar[bool] = False
    fused: InitVar[bool | None] = None
    decoupled_weight_decay: InitVar[bool] = False
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False
    ranges = {"lr": (0.0, float("inf")), "eps": (0.0, float("inf")),
              "beta1": (0.0, 1.0), "beta2": (0.0, 1.0),
              "weight_decay": (0.0, float("inf"))}

    def __post_init__(self, betas: tuple[float, float] | None = None,  # type: ignore[override]
                      amsgrad: bool = False, maximize: bool = False,
                      foreach: bool | None = None, capturable: bool = False,
                      differentiable: bool = False, fused: bool | None = None,
                      decoupled_weight_decay: bool = False) -> None:
        name = type(self).__name__
        _torch_only(name, amsgrad=amsgrad, maximize=maximize,
                    decoupled_weight_decay=decoupled_weight_decay)
        if isinstance(self.beta1, (tuple, list)):  # torch.optim's positional order
            raise InputError(f"{name}(lr, {self.beta1!r}, ...): the second positional argument "
                             "is beta1 here (torch.optim's is betas): give "
                             f"betas={tuple(self.beta1)!r} and the rest by keyword")
        if betas is not None:
            try:
                beta1, beta2 = betas
            except (TypeError, ValueError):
                raise InputError(f"{name}(betas={betas!r}): give two numbers, e.g. "
                                 "betas=(0.9, 0.999)") from None
            if (self.beta1, self.beta2) not in ((0.9, 0.999), (beta1, beta2)):
                raise InputError(f"{name}(betas={betas!r}, beta1={self.beta1!r}, "
                                 f"beta2={self.beta2!r}): give betas or beta1/beta2, not both")
            self.beta1, self.beta2 = beta1, beta2
        super().__post_init__()  # torch.optim's range checks, betas included

    def update(self) -> str:
        # Always applied (0 changes nothing), so set_hyperparams(weight_decay=...) takes effect.
        decay = ("p = p * (1.0 - lr * weight_decay);" if self.decoupled
                 else "g = g + weight_decay * p;")
        return "\n".join([
            decay,
            # 1 - beta too comes from the host: f32(0.9999) is 0.99989998, so 1 - beta2 in f32
            # would be 1.66e-4 off, relatively, in every second-moment increment.
            "exp_avg = exp_avg + bias[0] * (g - exp_avg);",
            "exp_avg_sq = beta2 * exp_avg_sq + bias[1] * g * g;",
            # torch: bias_correction1 = 1 - beta1**t and sqrt(1 - beta2**t) in float64 on the
            # host; in f32 the subtraction magnifies pow's few-ulp error ~1000x in early steps.
            f"var bias1 = 1.0 - exp(t * bias[{LOG_BETAS}u]);",
            f"var bias2_sqrt = sqrt(1.0 - exp(t * bias[{LOG_BETAS + 1}u]));",
            f"if (t <= {BIAS_TABLE_STEPS}.0) {{",
            "  let row = 2u * u32(t); bias1 = bias[row]; bias2_sqrt = bias[row + 1u];",
            "}",
            "let denom = sqrt(exp_avg_sq) / bias2_sqrt + eps;",
            "p = p - (lr / bias1) * exp_avg / denom;",
        ])

    def tables(self, hyperparams: dict[str, float]) -> dict[str, np.ndarray]:
        """"bias": 1 - beta1, 1 - beta2, then per step t = 1.. the bias corrections
        1 - beta1**t and sqrt(1 - beta2**t), then log(beta1), log(beta2) for the later steps,
        all in float64 rounded to f32 as torch rounds its host-side scalars."""
        beta1, beta2 = hyperparams["beta1"], hyperparams["beta2"]
        t = np.arange(1, BIAS_TABLE_STEPS + 1, dtype=np.float64)
        bias1 = 1.0 - beta1 ** t
        bias2_sqrt = np.sqrt(1.0 - beta2 ** t)
        rows = np.stack([bias1, bias2_sqrt], 1).reshape(-1)
        # beta = 0 (allowed) has no logarithm; f32's smallest normal's gives exp(t * it) = 0
        logs = np.log(np.maximum([beta1, beta2], np.finfo(np.float32).tiny))
        return {"bias": np.concatenate([[1.0 - beta1, 1.0 - beta2], rows, logs]
                                       ).astype(np.float32)}


@dataclass
class AdamW(Adam):
    """Adam with decoupled weight decay (torch.optim.AdamW; its default decay is 0.01)."""

    weight_decay: float = 1e-2
    decoupled = True
