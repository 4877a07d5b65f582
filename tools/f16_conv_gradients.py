"""Do f16 forward convolutions keep a batch-norm ResNet's gradients within PROTOCOL.md's gates,
whatever the kernels? float64 torch twice on the same weights and inputs (vkml's ResNet, in
its training form: batch statistics): once exact, once with every convolution's input and
weight rounded to f16 (or bf16) and summed exactly, as cooperative tiles with f32 accumulators
nearly do; the gradients' gates between the two (the worst norm error and cosine over the
parameters), and how far each batch norm's weight and bias gradients cancel (sum |dy x_hat| /
|sum dy x_hat|, over its channels as vectors): rounding of relative size e in the terms can
move such a gradient by up to e times that.

    python tools/f16_conv_gradients.py                  # the tiny bottleneck ResNet, 3 inputs
    python tools/f16_conv_gradients.py --model resnet50 --seeds 0   # ResNet-50 at 4 x 224^2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch_reference  # noqa: E402

from vkml.models import resnet  # noqa: E402

# PROTOCOL.md: per-parameter gradient norm error and cosine
NORM_GATE, COSINE_GATE = 5e-2, 0.99


def gradients(module, x: torch.Tensor, labels: torch.Tensor, rounded: torch.dtype | None,
              norms: dict | None = None) -> dict[str, np.ndarray]:
    """Every parameter's gradient of the cross-entropy, the convolutions' operands rounded to
    `rounded` in the forward pass (None: exact); `norms`, if given, gets each batch norm's
    cancellation of its weight's and bias's gradients."""
    module.zero_grad()
    conv2d = F.conv2d

    def rounded_conv(x, w, *args, **kwargs):  # the rounding as a straight-through step
        x = x + (x.detach().to(rounded).double() - x.detach())
        w = w + (w.detach().to(rounded).double() - w.detach())
        return conv2d(x, w, *args, **kwargs)

    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: seen.update(
        {name: (i[0].detach(), o, m.eps)}) or o.retain_grad())
        for name, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    torch.nn.modules.conv.F.conv2d = rounded_conv if rounded is not None else conv2d
    try:
        module(x, labels)[1].backward()
    finally:
        torch.nn.modules.conv.F.conv2d = conv2d
        for h in hooks:
            h.remove()
    if norms is not None:
        for name, (inp, out, eps) in seen.items():
            mean = inp.mean((0, 2, 3), keepdim=True)
            xhat = (inp - mean) / torch.sqrt(inp.var((0, 2, 3), unbiased=False, keepdim=True)
                                             + eps)
            terms = out.grad * xhat
            norms[name] = tuple(float(t.abs().sum((0, 2, 3)).norm() / t.sum((0, 2, 3)).norm())
                                for t in (terms, out.grad))
    return {n: p.grad.numpy().ravel().copy() for n, p in module.named_parameters()}


def gates(got: dict, want: dict) -> tuple[tuple[float, str], tuple[float, str]]:
    """The worst per-parameter norm error and the lowest cosine, each with its parameter."""
    norm = max((abs(np.linalg.norm(got[n]) - np.linalg.norm(w)) / np.linalg.norm(w), n)
               for n, w in want.items())
    cosine = min((float(got[n] @ w / (np.linalg.norm(got[n]) * np.linalg.norm(w))), n)
                 for n, w in want.items())
    return norm, cosine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "resnet50"), default="tiny")
    parser.add_argument("--seeds", default="1234,1,2", help="inputs, one run each")
    opts = parser.parse_args()
    cfg = resnet.tiny("bottleneck") if opts.model == "tiny" else resnet.resnet50()
    built = resnet.build(cfg)
    torch.manual_seed(0)
    module = torch_reference.ResNet(cfg).double()
    for m in module.modules():  # torchvision's (and vkml's) initialisation
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    for seed in (int(s) for s in opts.seeds.split(",")):
        inputs = built.sample_inputs(np.random.default_rng(seed))
        x = torch.tensor(inputs["x"], dtype=torch.float64)
        labels = torch.tensor(inputs["labels"]).long()
        norms: dict = {}
        exact = gradients(module, x, labels, None, norms)
        for label, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
            (norm, worst), (cosine, lowest) = gates(gradients(module, x, labels, dtype), exact)
            verdict = "passes" if norm < NORM_GATE and cosine > COSINE_GATE else "FAILS"
            print(f"{opts.model} input {seed}: convolution operands in {label}: worst norm error "
                  f"{norm:.3f} ({worst}), lowest cosine {cosine:.4f} ({lowest}): {verdict} the "
                  f"gates ({NORM_GATE}, {COSINE_GATE})", flush=True)
        top = sorted(norms.items(), key=lambda kv: -max(kv[1]))[:4]
        print("  most cancelling batch norm gradients (weight, bias): " + "; ".join(
            f"{n} {w:.0f}, {b:.0f}" for n, (w, b) in top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
