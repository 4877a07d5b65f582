"""Kernel lab: every GEMM tiling on the shapes the reference models run, checked against float64
numpy and timed with device timestamps, in one run, so one call on a lent GPU compares them all.
`--f16-operands` adds, for each given tiling on the 2-D matmul cases, the same product with A
and B held in memory as f16 (what f16 copies of the operands would give the cooperative
kernel: half the bytes read; checked against float64 of the f16-rounded operands).

    python tools/kernel_lab.py                      # the default shapes, every tiling
    python tools/kernel_lab.py --quick              # small shapes (lavapipe: correctness)
    python tools/kernel_lab.py --out DIR            # also lab.json there (after every case)
    python tools/kernel_lab.py --tilings c128x256k32f4x4,s64x64k32r4x4   # any tiling by name
    python tools/kernel_lab.py --f16-operands ...   # also each tiling reading f16 from memory
    python tools/kernel_lab.py --tilings s128x128k8r8x8,s128x128k8r8x8h   # f32 and f16 staged
    python tools/kernel_lab.py --channels-last --out DIR   # ResNet-50 inference's convolutions
                                                           # over channels-last f16 operands

Each case is a graph of one matmul or convolution (of the kind the models' forward and backward
passes make) compiled as usual, whose kernel is then regenerated with each forced tiling; the
"auto" row is what codegen chooses ("auto-f16" at precision="f16" on cooperative matrices,
"auto-bf16" at precision="bf16" where they take bfloat16, "auto-f16-staged" on the staged f16
tiles that devices with f16 arithmetic but no cooperative matrices take,
Capabilities.f16_products "simt"), timed again last ("auto-again": a change of
more than 10% is printed as drift, the GPU's clocks having moved while the case ran). A row
reports the median GPU ms over --reps steps (the profile's timestamps), TFLOP/s and the
relative L2 error against float64.

`--channels-last` runs another lab (CHANNELS_LAST_VARIANTS says which variants): every
distinct convolution of ResNet-50's 4 x 224^2 inference and the whole network's inference, f32
against f16 as today against cooperative tiles on NCHW operands against channels-last f16
copies, into DIR/channels_last.txt and .json, so kernels/conv.py CHANNELS_LAST_MIN is set from
numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vkml  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.kernels import conv, gemm, matmul  # noqa: E402
from vkml.kernels.common import Buf  # noqa: E402
from vkml.session import Session  # noqa: E402

# (label, a shape, b shape, transpose_a, transpose_b): SmolLM2/SmolVLA projections forward and
# their gradients (dX = dY W, dW = dY^T X), the LM head, attention's batched products, one
# square matmul.
MATMULS = [
    ("square 4096", (4096, 4096), (4096, 4096), False, False),
    ("square 1024", (1024, 1024), (1024, 1024), False, False),
    ("smollm2 up fwd", (128, 576), (1536, 576), False, True),
    ("smollm2 down fwd", (128, 1536), (576, 1536), False, True),
    ("smollm2 q fwd", (128, 576), (576, 576), False, True),
    ("smollm2 kv fwd", (128, 576), (192, 576), False, True),
    ("smollm2 up dX", (128, 1536), (1536, 576), False, False),
    ("smollm2 up dW", (128, 1536), (128, 576), True, False),
    ("smollm2 lm head", (128, 576), (49152, 576), False, True),
    ("smollm2 scores", (1, 9, 128, 64), (1, 9, 128, 64), False, True),
    ("whisper qkv fwd", (1500, 384), (384, 384), False, True),
    ("whisper ffn dW", (1500, 1536), (1500, 384), True, False),
    ("whisper ffn down fwd", (1500, 1536), (384, 1536), False, True),
    ("whisper attn PV", (1, 6, 1500, 1500), (1, 6, 1500, 64), False, False),
    ("whisper attn scores", (1, 6, 1500, 64), (1, 6, 1500, 64), False, True),
    ("smollm2 down dX", (128, 576), (576, 1536), False, False),
]
# (label, x shape, weight shape, stride, padding): ResNet-50 at 4 x 224^2 and the U-Net at
# 2 x 32^2; each is timed forward and both gradients.
CONVS = [
    ("resnet conv1 7x7/2", (4, 3, 224, 224), (64, 3, 7, 7), 2, 3),
    ("resnet l1 3x3", (4, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    ("resnet l1 1x1 up", (4, 64, 56, 56), (256, 64, 1, 1), 1, 0),
    ("resnet l3 3x3", (4, 256, 14, 14), (256, 256, 3, 3), 1, 1),
    ("resnet l4 1x1 down", (4, 2048, 7, 7), (512, 2048, 1, 1), 1, 0),
    ("unet 3x3 64", (2, 64, 32, 32), (64, 64, 3, 3), 1, 1),
    ("unet 3x3 256", (2, 256, 8, 8), (256, 256, 3, 3), 1, 1),
    ("resnet l2 3x3", (4, 128, 28, 28), (128, 128, 3, 3), 1, 1),
    ("resnet l4 3x3", (4, 512, 7, 7), (512, 512, 3, 3), 1, 1),
    ("resnet l3 down 1x1/2", (4, 512, 28, 28), (1024, 512, 1, 1), 2, 0),
]
QUICK_CONVS = [("small 3x3", (2, 3, 9, 7), (5, 3, 3, 3), 1, 1),
               ("split wgrad", (4, 2, 32, 32), (3, 2, 3, 3), 1, 1)]
GEMM_OPS = {"matmul": matmul.generate, "fused_matmul": matmul.generate,
            "conv2d": conv.generate_conv2d, "conv2d_input_grad": conv.generate_conv2d_input_grad,
            "conv2d_weight_grad": conv.generate_conv2d_weight_grad,
            "fused_conv2d": conv.generate_conv2d,
            "fused_conv2d_input_grad": conv.generate_conv2d_input_grad}
QUICK = [
    ("edges", (70, 21), (21, 33), False, False),
    ("nt", (130, 200), (70, 200), False, True),
    ("tn", (200, 130), (200, 70), True, False),
    ("tt", (40, 70), (33, 40), True, True),
    ("batched", (3, 20, 17), (17, 18), False, False),
    # multiples of 4 along memory: read four elements at a time (ragged tiles and k ranges)
    ("wide nn", (68, 96), (96, 36), False, False),
    ("wide tn", (40, 132), (40, 36), True, False),
    ("wide nt batched", (2, 3, 36, 20), (2, 3, 44, 20), False, True),
]


def matmul_case(device: vkml.Device, a_shape, b_shape, ta: bool, tb: bool, rng):
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a_shape, init=a), g.param("b", b_shape, init=b)
    g.output("c", g.matmul(pa, pb, transpose_a=ta, transpose_b=tb))
    a64 = np.swapaxes(a, -1, -2).astype(np.float64) if ta else a.astype(np.float64)
    b64 = np.swapaxes(b, -1, -2).astype(np.float64) if tb else b.astype(np.float64)
    return g, a64 @ b64


def half_case(a_shape, b_shape, ta: bool, tb: bool, rng):
    """matmul_case's graph with A and B rounded to f16 and packed into the first half of their
    f32 parameters' bytes (the rest zero), for `half_matmul`; and float64 of the product."""
    halves = [rng.standard_normal(shape).astype(np.float16) for shape in (a_shape, b_shape)]
    g = vkml.Graph()
    params = []
    for name, h in zip("ab", halves):
        packed = np.zeros(h.size, np.float32)
        packed[:h.size // 2] = np.frombuffer(h.tobytes(), np.float32)
        params.append(g.param(name, h.shape, init=packed.reshape(h.shape)))
    g.output("c", g.matmul(*params, transpose_a=ta, transpose_b=tb))
    a64, b64 = (h.astype(np.float64) for h in halves)
    return g, (a64.T if ta else a64) @ (b64.T if tb else b64)


def half_matmul(node, caps, tiling) -> vkml.hal.Kernel:
    """The 2-D matmul `node` with `tiling`, its operands read from memory as f16 (four to a
    load), as `half_case` packs them; the product stored plain."""
    a, b = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    m, n = node.shape
    k = a.shape[0] if ta else a.shape[1]

    def operand(buffer: str, at, contiguous) -> gemm.Operand:
        return gemm.Operand(
            lambda i, d: [f"{{ let e = {at(i, d)}; v = f32({buffer}[e / 4u][e % 4u]); }}"],
            contiguous, lambda i, d: f"vec4<f32>({buffer}[({at(i, d)}) / 4u])")

    a_op = operand("mat_a", (lambda i, d: f"{d} * {m}u + {i}") if ta
                   else (lambda i, d: f"{i} * {k}u + {d}"), "row" if ta else "depth")
    b_op = operand("mat_b", (lambda j, d: f"{j} * {k}u + {d}") if tb
                   else (lambda j, d: f"{d} * {n}u + {j}"), "depth" if tb else "row")
    return gemm.generate(
        "matmul_f16_operands", caps,
        [Buf("mat_a", "vec4<f16>"), Buf("mat_b", "vec4<f16>"), Buf("mat_c", writable=True)],
        m, n, k, 1, a_op, b_op, lambda r, c, acc: [f"mat_c[{r} * {n}u + {c}] = {acc};"],
        tiling, prelude=[] if isinstance(tiling, gemm.CoopTiling) else ["enable f16;"],
        flops=2 * m * n * k, nbytes=2 * (a.size + b.size) + 4 * m * n)


def run(device: vkml.Device, g: vkml.Graph, loss, tiling, reps: int, caps,
        splits: int | None = None, make=None) -> tuple:
    """A session of `g` whose GEMM kernels use `tiling` (codegen's choice when None), or are
    `make(node, caps, tiling)`, and, with `splits`, that many partial sums (the split stage's
    choice when None): the session after one step, and per GEMM op its kernel's name and the
    median GPU ms of its dispatch plus the sum of its partials. The GPU is kept busy for a
    moment first, so its clocks are up."""
    forced = gemm.splits if splits is None else (lambda *args, **kwargs: splits)
    original, gemm.splits = gemm.splits, forced
    try:
        stages = lower(g, caps, loss=loss, precision=caps.precision)
    finally:
        gemm.splits = original
    plan, nodes = stages.plan, stages.nodes
    if tiling is not None:
        plan = dataclasses.replace(plan, dispatches=tuple(
            dataclasses.replace(d, kernel=(make or GEMM_OPS[d.op])(node, caps, tiling))
            if d.op in GEMM_OPS else d for d, node in zip(plan.dispatches, nodes)))
    session, profile = profiled(device, plan, reps)
    times: dict = {}
    sums = {node.inputs[0].id: ms for node, ms in zip(nodes, profile.dispatch_ms)
            if node is not None and node.op == "fused_sum"}
    for d, node, ms in zip(plan.dispatches, nodes, profile.dispatch_ms):
        if d.op in GEMM_OPS:
            times[d.op] = (d.kernel.name, ms + sums.get(node.id, 0.0))
    return session, times, profile.source


def profiled(device: vkml.Device, plan, reps: int, feed=None) -> tuple[Session, object]:
    """A session of `plan` after one step, a moment of steps to bring the GPU's clocks up, and
    `reps` timestamped steps: the session and its profile. `feed(session)`: sets its inputs
    (and parameters) first."""
    session = Session(plan, device)
    if feed is not None:
        feed(session)
    session.step()
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        session.step()
        session.wait()
    return session, session.profile(steps=reps)


# Seconds of steps before the timed ones. 0.05 was too short on the H200: the clocks dropped while
# each variant compiled, and the same kernel timed 0.048 ms as "auto" and 0.104 ms forced a
# moment later (4096^3: 4.26 and 14.5 ms), so variants timed later looked faster
# (lab-20261201-h200-double-buffer).
WARM_S = 0.5


def report(rows: list, label: str, tiling: str, auto: bool, times: dict, errors: dict,
           flop: dict, limit: float, splits: int | None) -> None:
    for op, (name, ms) in times.items():
        tflops = flop[op] / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
        err = errors.get(op, errors.get("all", 0.0))
        rows.append({"case": label, "op": op, "tiling": tiling, "kernel": name,
                     "splits": splits, "ms": ms, "tflops": tflops, "err": err, "limit": limit})
        shown = f"{tiling}:{name.rsplit('_', 1)[-1]}" if auto else tiling
        shown += f" /{splits or 'a'}"
        print(f"{label[:22]:22} {op[:18]:18} {shown:24} {ms:9.4f} {tflops:8.2f} {err:9.2e}",
              flush=True)


DRIFT = 0.1  # the largest change between the two timings of codegen's choice taken as noise


def warn_drift(rows: list, label: str) -> None:
    """Print where codegen's choice, timed first and again last, changed by more than DRIFT:
    then the case's variants were timed at different clocks and compare only roughly."""
    first = {(r["op"], r["splits"]): r["ms"] for r in rows
             if r["case"] == label and r.get("tiling") == "auto"}
    for r in rows:
        key = (r.get("op"), r.get("splits"))
        if r["case"] == label and r.get("tiling") == "auto-again" and first.get(key):
            change = r["ms"] / first[key] - 1
            if abs(change) > DRIFT:
                print(f"{label[:22]:22} {key[0][:18]:18} drift: codegen's choice took "
                      f"{first[key]:.4f} ms first and {r['ms']:.4f} ms last ({change:+.0%}): "
                      "this case's variants ran at different clocks")


def conv_case(a_shape, w_shape, stride, padding, rng):
    import torch
    import torch.nn.functional as F

    x = rng.standard_normal(a_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    g = vkml.Graph()
    px, pw = g.param("x", a_shape, init=x), g.param("w", w_shape, init=w)
    y = g.output("c", g.conv2d(px, pw, stride=stride, padding=padding))
    weights = rng.standard_normal(y.shape).astype(np.float32)
    loss = g.sum(g.mul(y, g.constant(weights)))
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    ty = F.conv2d(tx, tw, stride=stride, padding=padding)
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    expected = {"conv2d": ty.detach().numpy(), "conv2d_input_grad": tx.grad.numpy(),
                "conv2d_weight_grad": tw.grad.numpy()}
    n, _, oh, ow = y.shape
    flop = 2 * n * oh * ow * int(np.prod(w_shape))
    return g, loss, expected, dict.fromkeys(expected, flop)


def parse_tiling(name: str) -> gemm.Tiling | gemm.CoopTiling:
    """A tiling from its name (as str() writes it), so a lab can time tilings no list holds."""
    staged = re.fullmatch(r"s(\d+)x(\d+)k(\d+)r(\d+)x(\d+)(h?)", name)
    coop = re.fullmatch(r"c(\d+)x(\d+)k(\d+)f(\d+)x(\d+)", name)
    tiling: gemm.Tiling | gemm.CoopTiling | None = None
    if staged:
        bm, bn, bk, tm, tn = map(int, staged.groups()[:5])
        if not (bm % tm or bn % tn or tm % 4 or tn % 4):
            tiling = gemm.Tiling(bm, bn, tm, tn, bk, True, f16=staged.group(6) == "h")
    elif coop:
        bm, bn, bk, fm, fn = map(int, coop.groups())
        tiling = gemm.CoopTiling(bm // (16 * fm), bn // (16 * fn), fm, fn, bk)
    if tiling is None or str(tiling) != name:
        raise SystemExit(f"--tilings: {name!r} is not a tiling: s<BM>x<BN>k<BK>r<TM>x<TN> (staged; "
                         "TM, TN multiples of 4 dividing BM, BN) or c<BM>x<BN>k<BK>f<FM>x<FN> "
                         "(cooperative; BM a multiple of 16 FM, BN of 16 FN)")
    return tiling


def half_variants(device: vkml.Device, rows: list, label: str, case: tuple, tilings: list,
                  staged_caps, reps: int, rng) -> None:
    """Each of `tilings` on the matmul `case` with f16 operands in memory (`half_matmul`),
    unsplit; rows named "<tiling>:f16mem"."""
    a_shape, b_shape, ta, tb = case
    if len(a_shape) != 2 or any(d % 4 for d in (*a_shape, *b_shape)):
        print(f"{label[:22]:22} {'':18} f16 operands: 2-D matmuls of multiples of 4 only")
        return
    g, expected = half_case(a_shape, b_shape, ta, tb, rng)
    flop = {"matmul": 2 * expected.size * (a_shape[0] if ta else a_shape[1])}
    for tiling in tilings:
        caps = dataclasses.replace(staged_caps, precision="f16" if isinstance(
            tiling, gemm.CoopTiling) else "f32")
        name = f"{tiling}:f16mem"
        try:
            session, times, _ = run(device, g, None, tiling, reps, caps, 1, half_matmul)
            errors = {"matmul": rel(session.read("c"), expected)}
            session.close()
        except Exception as exc:  # a variant the device refuses is a result too
            failed(rows, label, name, exc)
            continue
        report(rows, label, name, False, times, errors, flop, 5e-3, 1)


def failed(rows: list, label: str, name: str, exc: Exception) -> None:
    """Record and print a variant that raised (a tiling the device refuses is a result too)."""
    error = f"{type(exc).__name__}: {exc}"[:300]
    rows.append({"case": label, "tiling": name, "error": error})
    print(f"{label[:22]:22} {'':18} {name:24} failed: {error[:60]}")


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))



# --channels-last: accelerated inference's convolutions over channels-last f16 operands
# (kernels/conv.py `channels_last`) against today's choices, on every distinct convolution of
# ResNet-50's 4 x 224^2 inference and on the whole network. The variants, each checked against
# float64 torch:
#   f32         precision="f32" (strict)
#   f16-today   precision="f16" with today's rule (CHANNELS_LAST_MIN as committed)
#   coop-nchw   precision="f16", cooperative tiles forced on every convolution, NCHW f32
#               operands gathered and converted as they are staged (devices with cooperative
#               matrices only)
#   chlast      precision="f16", every convolution over channels-last f16 copies
#               (CHANNELS_LAST_MIN = 0): cooperative tiles, or staged f16 ones where the device
#               has no cooperative matrices; its rows add the copies' time ("copies")
# and last the whole network at the threshold the convolutions' rows suggest ("chlast>=T",
# `suggest_threshold`), where that is neither every convolution nor none.
CHANNELS_LAST_VARIANTS = ("f32", "f16-today", "coop-nchw", "chlast")


@contextlib.contextmanager
def convolution_rule(variant: str):
    """The convolution rules of `variant` while a plan is lowered."""
    saved = conv.CHANNELS_LAST_MIN, conv.coop_min
    if variant.startswith("chlast"):  # "chlast": every convolution; "chlast>=T": from T on
        least = int(variant.partition(">=")[2] or 0)
        conv.CHANNELS_LAST_MIN = dict.fromkeys(saved[0], least)
    if variant == "coop-nchw":
        conv.CHANNELS_LAST_MIN = dict.fromkeys(saved[0])
        conv.coop_min = lambda node: (0, 0)
    try:
        yield
    finally:
        conv.CHANNELS_LAST_MIN, conv.coop_min = saved


def resnet_convolutions(cfg) -> list[tuple]:
    """Every distinct convolution of the ResNet `cfg`'s inference: (x shape, weight shape,
    stride, padding, groups, how many times the network runs it)."""
    from vkml.models import resnet
    seen: dict[tuple, int] = {}
    for node in resnet.build(cfg).graph.nodes:
        if node.op == "conv2d":
            a = node.attrs
            key = (node.inputs[0].shape, node.inputs[1].shape, a["stride"], a["padding"],
                   a["groups"])
            seen[key] = seen.get(key, 0) + 1
    return [(*key, count) for key, count in seen.items()]


def timed_variant(device: vkml.Device, g: vkml.Graph, variant: str, reps: int,
                  outputs: dict | None = None, feed=None) -> dict:
    """`g` lowered for `variant` (inference), fed (`profiled`), stepped, timed: the session's
    kernels, its
    timestamped GPU ms per step (median), split into the convolutions (with their partial
    sums), the channels-last copies and the rest, and the host's step-and-wait ms (median)."""
    caps = dataclasses.replace(device.caps, precision="f32" if variant == "f32" else "f16")
    with convolution_rule(variant):
        stages = lower(g, caps, outputs=outputs, precision=caps.precision)
    session, profile = profiled(device, stages.plan, reps, feed)
    parts = {"conv": 0.0, "copies": 0.0, "other": 0.0}
    summed = {n.inputs[0].id for n in stages.nodes if n is not None and n.op == "fused_sum"
              and "conv2d" in n.inputs[0].op}
    for node, ms in zip(stages.nodes, profile.dispatch_ms):
        part = ("other" if node is None else "copies" if node.op == conv.CHANNELS_LAST
                else "conv" if "conv2d" in node.op or (node.op == "fused_sum"
                                                       and node.inputs[0].id in summed)
                else "other")
        parts[part] += ms
    wall = []
    for _ in range(reps):
        start = time.perf_counter()
        session.step()
        session.wait()
        wall.append(1e3 * (time.perf_counter() - start))
    kernels = [d.kernel.name for d in stages.plan.dispatches]
    return {"session": session, "kernels": kernels, "gpu_ms": float(np.median(profile.step_ms)),
            "wall_ms": float(np.median(wall)), "source": profile.source,
            **{f"{k}_ms": v for k, v in parts.items()}}


def channels_last_lab(device: vkml.Device, opts) -> int:
    """The --channels-last lab (see CHANNELS_LAST_VARIANTS): one table and channels_last.json."""
    import torch
    import torch.nn.functional as F

    from vkml.models import resnet
    coop = device.caps.cooperative_matrix and device.caps.shader_f16
    f16 = dataclasses.replace(device.caps, precision="f16").f16_products is not None
    variants = [v for v in CHANNELS_LAST_VARIANTS
                if v == "f32" or f16 and (v != "coop-nchw" or coop)]
    notes = [f"device: {device.name} ({device.caps.device_type}); CHANNELS_LAST_MIN as "
             f"committed: {conv.CHANNELS_LAST_MIN}"]
    if not coop:
        notes.append("NOT MEASURED HERE: no cooperative matrices, so coop-nchw is skipped and "
                     "chlast runs the staged f16 tiles (correctness only; time it on a GPU "
                     "that has them)")
    if not f16:
        notes.append("NOT MEASURED HERE: no f16 arithmetic: only f32 runs")
    cfg = dataclasses.replace(resnet.tiny("bottleneck") if opts.quick else resnet.resnet50(),
                              bn="eval")
    ref = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(0)
    rows: list = []
    lines = [*notes, f"{'CxHxW -> out kxk/stride pad groups count [m x n x k]':60} "
             f"{'variant':9} "
             f"{'conv ms':>8} {'copies':>7} {'total':>8} {'vs f32':>6} {'rel err':>9}  kernel"]
    print("\n".join(lines), flush=True)

    def emit(row: dict) -> None:
        rows.append(row)
        if "error" in row:
            line = f"{row['case'][:60]:60} {row['variant']:9} failed: {row['error'][:70]}"
        else:
            base = next((r for r in rows if r["case"] == row["case"] and r["variant"] == "f32"
                         and "error" not in r), None)
            ratio = base["total_ms"] / row["total_ms"] if base and row["total_ms"] else 0.0
            line = (f"{row['case'][:60]:60} {row['variant']:9} {row['conv_ms']:8.4f} "
                    f"{row['copies_ms']:7.4f} {row['total_ms']:8.4f} {ratio:5.2f}x "
                    f"{row['err']:9.2e}  {row['kernel']}")
        lines.append(line)
        print(line, flush=True)

    def chosen(label: str) -> bool:  # --cases
        return not opts.cases or any(w in label for w in opts.cases.split(","))

    # the whole network first: a run cut short by a time limit keeps it
    label = f"resnet{'-tiny' if opts.quick else '-50'} {cfg.batch}x{cfg.image_size}^2 inference"
    if chosen(label):
        network(device, opts, cfg, variants, ref, rng, rows, lines)
        if opts.out:
            _write_channels_last(opts.out, device, notes, rows, lines)
    for x_shape, w_shape, stride, padding, groups, count in resnet_convolutions(cfg):
        case = (f"{'x'.join(map(str, x_shape[1:]))} -> {w_shape[0]} "
                f"{w_shape[2]}x{w_shape[3]}/s{stride[0]} p{padding[0]} g{groups} x{count}")
        if not chosen(case):
            continue
        # the implicit GEMM's m, n, k (what CHANNELS_LAST_MIN bounds; k before padding)
        out_hw = [conv.out_extent(x_shape[a], w_shape[a], stride[a - 2], padding[a - 2], 1)
                  for a in (2, 3)]
        gemm_mnk = (x_shape[0] * out_hw[0] * out_hw[1], w_shape[0] // groups,
                    int(np.prod(w_shape[1:])))
        case += f" [{'x'.join(map(str, gemm_mnk))}]"
        x = rng.standard_normal(x_shape).astype(np.float32)
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        g = vkml.Graph()
        g.output("y", g.conv2d(g.param("x", x_shape, init=x), g.param("w", w_shape, init=w),
                               stride=stride, padding=padding, groups=groups))
        want = F.conv2d(torch.tensor(x, dtype=torch.float64, device=ref),
                        torch.tensor(w, dtype=torch.float64, device=ref), stride=stride,
                        padding=padding, groups=groups).cpu().numpy()
        for variant in variants:
            try:
                got = timed_variant(device, g, variant, opts.reps)
                err = rel(got["session"].read("y"), want)
                got["session"].close()
            except Exception as exc:  # a variant the device refuses is a result too
                emit({"case": case, "variant": variant, "error": f"{type(exc).__name__}: {exc}"})
                continue
            (kernel,) = [k for k in got["kernels"] if "conv2d" in k]
            emit({"case": case, "variant": variant, "kernel": kernel, "err": err, "gemm": gemm_mnk,
                  "limit": 1e-5 if variant == "f32" else 1e-2, "count": count,
                  "conv_ms": got["conv_ms"], "copies_ms": got["copies_ms"],
                  "total_ms": got["conv_ms"] + got["copies_ms"]})
        if opts.out:
            _write_channels_last(opts.out, device, notes, rows, lines)

    best, estimates = suggest_threshold(rows)
    lines += estimates
    print("\n".join(estimates), flush=True)
    smallest = min((min(r["gemm"]) for r in rows if "gemm" in r), default=None)
    if best is not None and best != smallest and chosen(label):
        network(device, opts, cfg, [f"chlast>={best}"], ref, rng, rows, lines)
    if opts.out:
        _write_channels_last(opts.out, device, notes, rows, lines)
    bad = [r for r in rows if "error" in r or r["err"] > r["limit"]]
    print(f"{len(rows)} runs, {len(bad)} failed or over their limit (f32 1e-5, f16 1e-2)")
    return 1 if bad else 0


def suggest_threshold(rows: list) -> tuple[int | None, list[str]]:
    """The CHANNELS_LAST_MIN (None: off) under which the convolutions' rows add up to the
    least time a step: each distinct convolution its count times its chlast time (copies
    included: in the network a convolution writes most of them itself, so this leans against
    chlast) where its GEMM's smallest dimension reaches the threshold, else its f16-today time;
    and lines giving the estimate at each candidate."""
    by_case: dict[str, dict] = {}
    for r in rows:
        if "gemm" in r and "error" not in r:
            by_case.setdefault(r["case"], {})[r["variant"]] = r
    shapes = [(min(v["chlast"]["gemm"]), v["chlast"]["count"], v["chlast"]["total_ms"],
               v["f16-today"]["total_ms"]) for v in by_case.values()
              if "chlast" in v and "f16-today" in v]
    if not shapes:
        return None, []
    candidates: list[int | None] = [*sorted({s[0] for s in shapes}), None]
    estimate = {t: sum(count * (new if t is not None and low >= t else today)
                       for low, count, new, today in shapes) for t in candidates}
    best = min(candidates, key=lambda t: estimate[t])
    return best, ["estimated convolution ms a step, by CHANNELS_LAST_MIN (the smallest of "
                  "m, n, k that takes channels-last; off: none): " + ", ".join(
                      f"{'off' if t is None else t} {ms:.3f}" for t, ms in estimate.items()),
                  f"suggested CHANNELS_LAST_MIN: {best}"]


def network(device: vkml.Device, opts, cfg, variants: list, ref, rng, rows: list,
            lines: list) -> None:
    """The whole ResNet `cfg`'s inference in each variant: GPU ms (timestamped, split into
    convolutions, copies and the rest), wall ms, and the logits against float64 torch with the
    same weights and running statistics (set away from 0 and 1, so batch norm's inference
    form is not the identity)."""
    import torch

    from vkml.models import resnet
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch_reference
    built = resnet.build(cfg)
    params = {}
    for name, t in built.graph.params.items():
        shape = t.shape
        params[name] = (rng.uniform(0.5, 2.0, shape) if name.endswith("running_var") else
                        rng.standard_normal(shape) * 0.1 if name.endswith(("running_mean", "bias"))
                        else 1.0 + 0.1 * rng.standard_normal(shape) if ".bn" in name
                        or name.startswith("bn") or "downsample.1" in name
                        else rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:])))
        params[name] = params[name].astype(np.float32)
    images = rng.standard_normal(built.inputs["x"].shape).astype(np.float32)
    module = torch_reference.ResNet(cfg).double().to(ref)
    module.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()},
                           strict=False)
    with torch.no_grad():
        want, _ = module.eval()(torch.tensor(images, dtype=torch.float64, device=ref),
                                torch.zeros(cfg.batch, dtype=torch.int64, device=ref))
    want_logits = want["logits"].cpu().numpy()
    label = f"resnet{'-tiny' if opts.quick else '-50'} {cfg.batch}x{cfg.image_size}^2 inference"
    lines.append(f"{label}: {'variant':9} {'gpu ms':>8} {'conv':>8} {'copies':>7} "
                 f"{'wall ms':>8} {'rel err':>9}  kernels (convolutions: cooperative / all)")
    print(lines[-1], flush=True)
    def feed(session: Session) -> None:
        for name, value in params.items():
            session.set_param(name, value)
        session.set_input("x", images)

    for variant in variants:
        try:
            got = timed_variant(device, built.graph, variant, opts.reps, built.outputs, feed)
            session = got.pop("session")
            err = rel(session.read("logits"), want_logits)
            session.close()
        except Exception as exc:
            rows.append({"case": label, "variant": variant,
                         "error": f"{type(exc).__name__}: {exc}"[:300]})
            lines.append(f"{label}: {variant:9} failed: {rows[-1]['error'][:70]}")
            print(lines[-1], flush=True)
            continue
        convs = [k for k in got["kernels"] if "conv2d" in k and "input_grad" not in k]
        cooperative = sum(bool(re.search(r"_c\d+x\d+k\d+f\d+x\d+", k)) for k in convs)
        rows.append({"case": label, "variant": variant, "err": err, "limit": 1e-2,
                     "kernels": got["kernels"], "total_ms": got["gpu_ms"],
                     **{k: got[k] for k in ("gpu_ms", "wall_ms", "conv_ms", "copies_ms",
                                            "other_ms", "source")}})
        lines.append(f"{label}: {variant:9} {got['gpu_ms']:8.3f} {got['conv_ms']:8.3f} "
                     f"{got['copies_ms']:7.3f} {got['wall_ms']:8.3f} {err:9.2e}  "
                     f"{len(got['kernels'])} dispatches, {cooperative} / {len(convs)}")
        print(lines[-1], flush=True)


def _write_channels_last(out: Path, device: vkml.Device, notes: list, rows: list,
                         lines: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "channels_last.json").write_text(json.dumps(
        {"device": device.name, "notes": notes, "rows": rows}, indent=1))
    (out / "channels_last.txt").write_text("\n".join(lines) + "\n")

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tilings", default="all",
                        help="'all' (gemm's lists), 'auto' or names like s64x64k16r4x4, "
                             "s64x64k16r4x4h (f16 staged), c128x256k32f4x4, listed or not "
                             "(codegen's own choice always runs first: 'auto', 'auto-f16' for "
                             "precision='f16' where the device has cooperative matrices, "
                             "'auto-bf16' where they take bfloat16, "
                             "'auto-f16-staged' on matmuls where it has shaderFloat16)")
    parser.add_argument("--splits", default="auto",
                        help="'auto' (the split stage's choice) or counts like 1,2,4,8")
    parser.add_argument("--cases", default="", help="only cases whose label has one of these")
    parser.add_argument("--f16-operands", action="store_true",
                        help="also each tiling with the operands in memory as f16 (2-D matmuls "
                             "whose dimensions are multiples of 4; unsplit)")
    parser.add_argument("--channels-last", action="store_true",
                        help="the channels-last lab instead: ResNet-50's inference convolutions "
                             "and the whole network, f32 vs f16 today vs cooperative NCHW vs "
                             "channels-last f16 operands (--quick: the tiny ResNet)")
    opts = parser.parse_args()
    device = vkml.Device()
    if opts.channels_last:
        return channels_last_lab(device, opts)
    staged_caps = (dataclasses.replace(device.caps, device_type="discrete")
                   if opts.quick else device.caps)
    tilings: list = [t for t in gemm.STAGED if gemm._fits(t, staged_caps)]
    coop = device.caps.cooperative_matrix and device.caps.shader_f16
    if coop:
        tilings += list(gemm.COOP)
    if opts.tilings == "auto":
        tilings = []
    elif opts.tilings != "all":
        tilings = [parse_tiling(name) for name in opts.tilings.split(",")]
        if not coop and any(isinstance(t, gemm.CoopTiling) for t in tilings):
            raise SystemExit(f"--tilings: {device.name} has no cooperative matrices")
    rng = np.random.default_rng(0)
    rows: list = []
    print(f"device: {device.name} ({device.caps.device_type})")
    print(f"{'case':22} {'op':18} {'tiling':24} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    cases = [("matmul", c) for c in (QUICK if opts.quick else MATMULS)]
    cases += [("conv", c) for c in (QUICK_CONVS if opts.quick else CONVS)]
    if opts.cases:
        cases = [c for c in cases if any(w in c[1][0] for w in opts.cases.split(","))]
    split_counts = [None] if opts.splits == "auto" else [int(v) for v in opts.splits.split(",")]
    for kind, (label, sa, sb, p, q) in cases:
        if kind == "matmul":
            g, expected = matmul_case(device, sa, sb, p, q, rng)
            loss, flop = None, {"matmul": 2 * expected.size * (sa[-2] if p else sa[-1])}
        else:
            g, loss, conv_expected, flop = conv_case(sa, sb, p, q, rng)
        # codegen's own choice runs first and again last: the two timings of one kernel say
        # how far the GPU's clocks drifted while the case ran
        # "f16-staged": precision "f16" on this device's capabilities less its cooperative
        # matrices (matmuls only: convolutions stay f32 there)
        staged_f16 = device.caps.shader_f16 and kind == "matmul"
        variants = [(None, "f32"), *([(None, "f16")] if coop else []),
                    *([(None, "bf16")] if device.caps.bf16_cooperative_matrix else []),
                    *([(None, "f16-staged")] if staged_f16 else []),
                    *[(t, "f16" if isinstance(t, gemm.CoopTiling) else
                       "f16-staged" if t.f16 else "f32") for t in tilings],
                    *([(None, "f32")] if tilings else [])]
        runs = [(v, c) for v in variants for c in split_counts]
        for i, ((tiling, precision), splits) in enumerate(runs):
            caps = dataclasses.replace(staged_caps if tiling is not None else device.caps,
                                       precision=precision.removesuffix("-staged"))
            if precision == "f16-staged":
                caps = dataclasses.replace(caps, cooperative_matrix=False)
            # bfloat16 operands: ~2.4e-3 on these random products rounded to nearest, ~6e-3
            # toward zero (tests/gpu/test_accelerated.py BF16_MODEL_TOL)
            limit = 1e-2 if precision == "bf16" else 5e-3 if precision != "f32" else 1e-5
            name = str(tiling) if tiling is not None else (
                f"auto-{precision}" if precision != "f32" else
                "auto-again" if i >= len(runs) - len(split_counts) and tilings else "auto")
            try:
                session, times, _ = run(device, g, loss, tiling, opts.reps, caps, splits)
                if kind == "matmul":
                    errors = {"matmul": rel(session.read("c"), expected)}
                else:
                    errors = {"conv2d": rel(session.read("c"), conv_expected["conv2d"]),
                              "conv2d_input_grad": rel(session.grad("x"),
                                                       conv_expected["conv2d_input_grad"]),
                              "conv2d_weight_grad": rel(session.grad("w"),
                                                        conv_expected["conv2d_weight_grad"])}
                session.close()
            except Exception as exc:  # a variant the device refuses is a result too
                failed(rows, label, name, exc)
                continue
            report(rows, label, name, tiling is None, times, errors, flop, limit, splits)
        if opts.f16_operands and kind == "matmul":
            half_variants(device, rows, label, (sa, sb, p, q), tilings, staged_caps, opts.reps,
                          rng)
        warn_drift(rows, label)
        if opts.out:  # after every case: a run cut short by a time limit keeps what it timed
            opts.out.mkdir(parents=True, exist_ok=True)
            (opts.out / "lab.json").write_text(json.dumps({"device": device.name, "rows": rows},
                                                          indent=1))
    bad = [r for r in rows if r.get("err", 0) > r.get("limit", 1e-5) or "error" in r]
    print(f"{len(rows)} runs, {len(bad)} failed or above 1e-5")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("VKML_WAIT_TIMEOUT", "60")
    raise SystemExit(main())
