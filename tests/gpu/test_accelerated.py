"""Every accelerated kernel variant run on a GPU against float64 torch at PROTOCOL.md's gates:
the cooperative-matrix GEMM (tiles that divide C and edge tiles, fragments stored straight to C
and through workgroup memory, each transpose, batched, split sums, the largest tiles, the
backward pass's scaled operands), the cooperative convolution, the cooperative attention, and
the staged f16 tiles of devices without cooperative matrices (run here by compiling for this
GPU's capabilities less its cooperative matrices); and at precision "bf16", the same GEMM,
convolution (its weight gradient too) and attention kernels with bfloat16 operands, each also
matched to its arithmetic emulated in float64 (see BF16_MODEL_TOL). Also the table of special
values (tests/special_values.py: NaN, infinities and huge values through every op that compares
values, forward and backward, training and inference, in strict f32 and at precision "f16"
and "bf16"), which runs wherever the precision does, lavapipe too, but matters here: GPU
drivers fold selects into max and min and pick their NaN rule.

Each case asserts that the variant it names is the kernel that ran (a silent fall back to f32
would otherwise pass), records its kernels and errors, then asserts the gates; the records go
to $VKML_GPU_RESULTS as JSON at the end of the run where that is set, with a fingerprint of
the kernel sources. Lavapipe has no cooperative matrices, and there the staged f16 tiles are
checked by tests/test_gemm_paths.py and tests/test_models.py: every case here says so as it
skips. Run on the H200 before each change to the kernels (from the repo root, about a minute):

    . .gl/enter.sh; VKML_GPU_RESULTS=$OUT/results-h200.json python3 -m pytest -q -rs tests/gpu

and commit the file as tests/gpu/results-h200.json: everywhere, the suite then checks that
every case of that run passed, and says so as it skips where the run is missing or out of date
(kernel sources changed since, or cases added).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from special_values import run as run_special_values
from test_channels_last import chain_case, channels_last_case
from test_ops import (
    COOPERATIVE_ATTENTION,
    HEADS_INNER,
    SWAP_HEADS,
    cooperative_attention_case,
    cooperative_attention_reference,
)

import vkml
from vkml.compiler.stages import lower
from vkml.kernels import conv as conv_kernels
from vkml.session import Session

# PROTOCOL.md
FORWARD_GATE, GRAD_GATE, COSINE_GATE = 1e-2, 5e-2, 0.99
REF = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # float64 either way
COOP = r"_c\d+x\d+k\d+f\d+x\d+"  # kernels/gemm.py CoopTiling's name
STAGED_F16 = r"_s\d+x\d+k\d+r\d+x\d+h"  # a staged Tiling's, f16


@pytest.fixture(scope="module")
def device():
    """The Vulkan device alone: cooperative matrices are a Vulkan extension."""
    dev = vkml.Device(backend="vulkan")
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def results(device):
    """Cases append a dict each; written to $VKML_GPU_RESULTS once they have run."""
    cases: list[dict] = []
    yield cases
    path = os.environ.get("VKML_GPU_RESULTS")
    if path:
        caps = device.caps
        Path(path).write_text(json.dumps({
            "device": caps.device_name, "driver": caps.driver, "api": caps.api_version,
            "cooperative_matrix": caps.cooperative_matrix, "shader_f16": caps.shader_f16,
            "bf16_cooperative_matrix": caps.bf16_cooperative_matrix,
            "kernel_sources": kernel_sources(), "cases": cases}, indent=1) + "\n")


# The sources that decide and generate the kernels checked here, and the H200's committed run
KERNEL_SOURCES = ("vkml/kernels", "vkml/compiler", "vkml/ops", "vkml/hal/capabilities.py")
COMMITTED = Path(__file__).with_name("results-h200.json")


def kernel_sources() -> str:
    """A fingerprint (sha256) of KERNEL_SOURCES' Python files, paths and contents."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for source in KERNEL_SOURCES:
        path = root / source
        for f in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def test_committed_gpu_run_passed_and_is_current():
    # the H200's run committed as COMMITTED: every case it ran passed; where it is missing,
    # ran on other kernel sources, or lacks cases defined here, this says so as it skips
    if not COMMITTED.exists():
        pytest.skip(f"NOT CHECKED: no GPU run is committed ({COMMITTED.name}): run this "
                    "module on the H200 (the command is in its docstring) and commit the file")
    run = json.loads(COMMITTED.read_text())
    failed = [c["case"] for c in run["cases"] if not c["passed"]]
    assert not failed, f"the committed GPU run ({run['device']}) failed: {failed}"
    missing = sorted(case_names() - {c["case"] for c in run["cases"]})
    stale = run.get("kernel_sources") != kernel_sources()  # absent: made before fingerprints
    if stale or missing:
        pytest.skip(f"NOT CHECKED: the committed GPU run ({run['device']}, {COMMITTED.name}) "
                    "is out of date: " + "; ".join(
                        [*([f"{', '.join(KERNEL_SOURCES)} changed since"] if stale else []),
                         *([f"it lacks {missing}"] if missing else [])])
                    + ": rerun tests/gpu on the H200 and commit the file")


def case_names() -> set[str]:
    """The name each case records its result under."""
    return {f"{kind} {name}" for kind, cases in (
        ("cooperative matmul", MATMULS), ("cooperative matmul backward", BACKWARD),
        ("staged f16 matmul", STAGED), ("cooperative convolution", CONVS),
        ("cooperative channels-last convolution", CHANNELS_LAST),
        ("cooperative channels-last store", CHANNELS_LAST_STORES),
        ("cooperative attention", COOPERATIVE_ATTENTION), ("special values", PRECISIONS),
        ("bf16 matmul", MATMULS), ("bf16 matmul backward", BF16_BACKWARD),
        ("bf16 convolution", CONVS), ("bf16 attention", COOPERATIVE_ATTENTION))
        for name in cases} | {"bf16 convolution weight gradient"}


def needs(device, variant: str) -> None:
    """Skip, saying what was not checked and why, where this device cannot run `variant`."""
    caps = device.caps
    if variant == "cooperative" and not caps.cooperative_matrix:
        pytest.skip(f"NOT CHECKED: {caps.device_name} has no cooperative matrices "
                    "(VK_KHR_cooperative_matrix), so no cooperative GEMM, convolution or "
                    "attention kernel ran; run tests/gpu on a GPU that has them")
    if variant == "bf16" and not caps.bf16_cooperative_matrix:
        pytest.skip(f"NOT CHECKED: {caps.device_name} has no bfloat16 cooperative matrices "
                    "(VK_KHR_shader_bfloat16 with a 16x16x16 bfloat16 configuration), so no "
                    "precision='bf16' kernel ran; run tests/gpu on a GPU that has them")
    if variant == "staged_f16" and not caps.shader_f16:
        pytest.skip(f"NOT CHECKED: {caps.device_name} has no shaderFloat16: the staged f16 "
                    "tiles did not run")
    if variant == "staged_f16" and caps.device_type == "cpu":
        pytest.skip(f"not run here: {caps.device_name} is a CPU driver; tests/test_gemm_paths.py "
                    "and tests/test_models.py check the staged f16 tiles on it")


def tensor64(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64, device=REF, requires_grad=True)


def numpy64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def gate(results: list, case: str, kernels: list[str], forward: dict, grads: dict,
         models: dict[str, dict[str, np.ndarray]] | None = None,
         model_tolerance: float = 0.0) -> None:
    """Records then asserts PROTOCOL.md's gates: `forward` and `grads` map names to (vkml's
    array, the float64 reference). `models` (bf16 cases): for each rounding a conversion may
    take (ROUNDINGS), each name's array as the kernels' arithmetic gives it, emulated in
    float64; under one of the roundings, every array must lie within `model_tolerance` of
    its model (relative L2)."""
    pairs = [*forward.values(), *grads.values()]
    finite = all(bool(np.all(np.isfinite(a))) for a, _ in pairs)
    errors: dict[str, float] = {}
    for name, (a, want) in forward.items():
        errors[f"forward {name}"] = _rel(a, want)
    if grads:
        total = np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a, _ in grads.values()))
        ref_total = np.sqrt(sum(np.sum(np.square(w)) for _, w in grads.values()))
        errors["gradient total norm"] = float(abs(total - ref_total) / ref_total)
        for name, (a, want) in grads.items():
            a, want = a.astype(np.float64).ravel(), want.ravel()
            norm = np.linalg.norm(want)
            errors[f"gradient norm {name}"] = float(abs(np.linalg.norm(a) - norm) / norm)
            errors[f"gradient cosine {name}"] = float(a @ want / (np.linalg.norm(a) * norm))
            errors[f"gradient rel_l2 {name}"] = _rel(a, want)
    chosen = {}
    if models:
        arrays = {name: pair for name, pair in (*forward.items(), *grads.items())}
        mismatch = {rounding: {name: _rel(arrays[name][0], model)
                               for name, model in named.items()}
                    for rounding, named in models.items()}
        rounding = min(mismatch, key=lambda r: max(mismatch[r].values()))
        for name, value in mismatch[rounding].items():
            errors[f"bf16 model {name}"] = value
            # the model's own error against float64: what bfloat16 operands cost (reported)
            errors[f"bf16 model rel_l2 {name}"] = _rel(models[rounding][name], arrays[name][1])
        chosen = {"rounding": rounding}
    passed = finite and all(_passes(k, v, model_tolerance) for k, v in errors.items())
    results.append({"case": case, "kernels": kernels, "errors": errors, "finite": finite,
                    "gates": {"forward": FORWARD_GATE, "gradient norm": GRAD_GATE,
                              "cosine": COSINE_GATE,
                              **({"bf16 model": model_tolerance} if models else {})},
                    **chosen, "passed": passed})
    assert finite, f"{case}: NaN or Inf"
    assert passed, (case, errors)


def _passes(key: str, value: float, model_tolerance: float) -> bool:
    if "cosine" in key:
        return value > COSINE_GATE
    if "rel_l2" in key:  # reported, not a gate
        return True
    if key.startswith("bf16 model"):
        return value < model_tolerance
    return value < (FORWARD_GATE if key.startswith("forward") else GRAD_GATE)


def _rel(a: np.ndarray, want: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    assert a.shape == want.shape, (a.shape, want.shape)
    return float(np.linalg.norm(a - want) / np.linalg.norm(want))


def infer(g: vkml.Graph, device, precision: str = "f16") -> tuple[Session, list[str]]:
    """An inference of `g` at `precision` on the device, stepped once, and its kernels."""
    session = vkml.compile(g, precision=precision, device=device)
    session.step()
    return session, [d.kernel.name for d in session.plan.dispatches]


def products(session: Session, phase: str) -> list[str]:
    return [d.kernel.name for d in session.plan.dispatches
            if d.phase == phase and "matmul" in d.kernel.name]


# name: (a shape, b shape, transpose_a, transpose_b, a bias epilogue). All take cooperative
# tiles at precision "f16" (kernels/gemm.py COOP_MIN_MATMUL, matmul.COOP_MIN_DIRECT_DEPTH).
MATMULS = {
    "divides_tiles_straight_to_c": ((512, 384), (384, 1024), False, False, False),
    "edge_tiles_straight_to_c": ((1500, 384), (384, 1000), False, False, False),
    "edges_everywhere_epilogue": ((300, 520), (520, 200), False, False, True),
    "nt": ((300, 320), (260, 320), False, True, True),
    "tn": ((320, 300), (320, 260), True, False, False),
    "tt": ((320, 300), (260, 320), True, True, False),
    "batched_broadcast": ((3, 200, 256), (256, 136), False, False, False),
    "shallow_scores_64_deep": ((2, 300, 64), (2, 300, 64), False, True, False),
    "largest_tiles": ((4096, 1024), (1024, 2304), False, False, False),
    "split_sums": ((128, 8192), (8192, 128), False, False, False),
}
# Training products whose backward products take cooperative tiles too (gemm.SCALED_MIN_ROWS
# rows and more), their gradient operands scaled into f16's range (compiler/scale.py)
BACKWARD = {
    "nn": ((512, 384), (384, 640), False, False),
    "nt_bias": ((512, 384), (640, 384), False, True),
    "tn": ((384, 512), (384, 640), True, False),
    "read_twice": None,  # _read_twice_graph
}
# The staged f16 tiles (Capabilities.f16_products "simt"), forward and backward
STAGED = {
    "edges": ((300, 520), (520, 200), False, False),
    "nt": ((256, 320), (260, 320), False, True),
    "tt_batched": ((2, 320, 300), (260, 320), True, True),
    "square_1024": ((1024, 1024), (1024, 1024), False, False),
    "read_twice": None,  # _read_twice_graph
}


def _case_graph(cases: dict, name: str, rng):
    if cases[name] is None:
        return _read_twice_graph(rng)
    a_shape, b_shape, ta, tb = cases[name]
    return _matmul_graph(rng, a_shape, b_shape, ta, tb, name.endswith("bias"))


def _matmul_graph(rng, a_shape, b_shape, ta, tb, bias: bool):
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    product = g.matmul(g.param("a", a_shape, init=a), g.param("b", b_shape, init=b),
                       transpose_a=ta, transpose_b=tb)
    c = rng.standard_normal(product.shape[-1]).astype(np.float32) if bias else None
    y = g.output("y", g.add(product, g.constant(c)) if bias else product)
    ra, rb = tensor64(a), tensor64(b)
    want = (ra.transpose(-1, -2) if ta else ra) @ (rb.transpose(-1, -2) if tb else rb)
    if bias:
        want = want + torch.tensor(c, dtype=torch.float64, device=REF)
    return g, y, {"a": ra, "b": rb}, want


def _read_twice_graph(rng):
    """y = x w1 + x w2 with x (512, 384): x's gradient is dY w1^T + dY w2^T, its second
    product adding the first in an epilogue whose input is bound after the scales."""
    values = {n: rng.standard_normal(s).astype(np.float32)
              for n, s in (("x", (512, 384)), ("w1", (384, 384)), ("w2", (384, 384)))}
    g = vkml.Graph()
    x, w1, w2 = (g.param(n, v.shape, init=v) for n, v in values.items())
    y = g.output("y", g.add(g.matmul(x, w1), g.matmul(x, w2)))
    refs = {n: tensor64(v) for n, v in values.items()}
    return g, y, refs, refs["x"] @ refs["w1"] + refs["x"] @ refs["w2"]


def _train(rng, g, y, session_of, refs, want):
    """One gradient step of sum(y * w), w about 1e-7 (gradients below f16's smallest
    normal, as a loss's often are): the session, the forward and gradient pairs, and w."""
    weights = (rng.standard_normal(y.shape) * 1e-7).astype(np.float32)
    session = session_of(g.sum(g.mul(y, g.constant(weights))))
    session.step()
    (want * torch.tensor(weights, dtype=torch.float64, device=REF)).sum().backward()
    forward = {"y": (session.read("y"), numpy64(want))}
    grads = {n: (session.grad(n), numpy64(r.grad)) for n, r in refs.items()}
    return session, forward, grads, weights


def products_in_f16(session: Session, variant: str) -> list[str]:
    """Assert that every matrix product of a training session is the f16 variant `variant`
    (a kernel-name pattern), each of the backward pass's two per forward product scaled;
    returns the backward ones."""
    backward, forward_products = products(session, "backward"), products(session, "forward")
    assert len(backward) == 2 * len(forward_products) and all(
        re.search(variant + "_scaled$", k) for k in backward), backward
    assert all(re.search(variant + "$", k) for k in forward_products), forward_products
    return backward


@pytest.mark.parametrize("name", MATMULS)
def test_cooperative_matmul(name, device, results, rng):
    needs(device, "cooperative")
    a_shape, b_shape, ta, tb, bias = MATMULS[name]
    g, _, _, want = _matmul_graph(rng, a_shape, b_shape, ta, tb, bias)
    session, kernels = infer(g, device)
    (product,) = products(session, "forward")
    assert re.search(COOP, product), kernels
    if name == "split_sums":
        assert "_split" in product and any("fused_sum" in k for k in kernels), kernels
    gate(results, f"cooperative matmul {name}", kernels,
         {"y": (session.read("y"), numpy64(want))}, {})
    session.close()


@pytest.mark.parametrize("name", BACKWARD)
def test_cooperative_matmul_backward_scaled(name, device, results, rng):
    needs(device, "cooperative")
    g, y, refs, want = _case_graph(BACKWARD, name, rng)
    session, forward, grads, _ = _train(rng, g, y, lambda loss: vkml.compile(
        g, loss=loss, keep_grads=True, precision="f16", device=device), refs, want)
    backward = products_in_f16(session, COOP)
    if name == "read_twice":
        assert any(k.startswith("fused_matmul") for k in backward), backward
    gate(results, f"cooperative matmul backward {name}",
         [d.kernel.name for d in session.plan.dispatches], forward, grads)
    session.close()


@pytest.mark.parametrize("name", STAGED)
def test_staged_f16_matmul_forward_and_backward(name, device, results, rng):
    needs(device, "staged_f16")
    caps = dataclasses.replace(device.caps, cooperative_matrix=False)
    g, y, refs, want = _case_graph(STAGED, name, rng)
    session, forward, grads, _ = _train(rng, g, y, lambda loss: Session(lower(
        g, caps, loss=loss, keep_grads=True, precision="f16").plan, device), refs, want)
    products_in_f16(session, STAGED_F16)
    gate(results, f"staged f16 matmul {name}", [d.kernel.name for d in session.plan.dispatches],
         forward, grads)
    session.close()


# x shape, weight shape, stride, padding, a ReLU epilogue: from gemm.COOP_MIN (2048) in every
# dimension of the implicit GEMM, forward only (their gradients stay f32)
CONVS = {
    "3x3_divides": ((1, 256, 48, 48), (2048, 256, 3, 3), 1, 1, False),
    "3x3_edges_relu": ((1, 232, 47, 45), (2056, 232, 3, 3), 1, 1, True),
    "1x1_pointwise": ((2, 2048, 32, 32), (2048, 2048, 1, 1), 1, 0, False),
}


def _conv_case(name: str, rng) -> tuple[vkml.Graph, np.ndarray, np.ndarray]:
    """CONVS[name]'s graph (output "y") and its x and w."""
    x_shape, w_shape, stride, padding, relu = CONVS[name]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    g = vkml.Graph()
    y = g.conv2d(g.param("x", x_shape, init=x), g.param("w", w_shape, init=w), stride=stride,
                 padding=padding)
    g.output("y", g.relu(y) if relu else y)
    return g, x, w


def _conv_reference(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _, _, stride, padding, relu = CONVS[name]
    want = F.conv2d(x, w, stride=stride, padding=padding)
    return torch.relu(want) if relu else want


def _conv_kernel(name: str, kernels: list[str]) -> None:
    (conv,) = kernels  # the ReLU in its epilogue
    assert conv.startswith("fused_conv2d" if CONVS[name][4] else "conv2d") \
        and re.search(COOP, conv), kernels


@pytest.mark.parametrize("name", CONVS)
def test_cooperative_convolution(name, device, results, rng, monkeypatch):
    # the cooperative tiles over NCHW f32 operands: channels-last copies off (tested below)
    needs(device, "cooperative")
    monkeypatch.setattr(conv_kernels, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv_kernels.CHANNELS_LAST_MIN))
    g, x, w = _conv_case(name, rng)
    session, kernels = infer(g, device)
    _conv_kernel(name, kernels)
    want = _conv_reference(name, tensor64(x), tensor64(w))
    gate(results, f"cooperative convolution {name}", kernels,
         {"y": (session.read("y"), numpy64(want))}, {})
    session.close()


# Accelerated inference's convolutions over channels-last f16 copies of their operands
# (kernels/conv.py `channels_last`, forced on here whatever CHANNELS_LAST_MIN says): x shape,
# weight shape, stride, padding, groups, epilogue ("" | "bias_relu" | "residual")
CHANNELS_LAST = {
    "3x3_bias_relu": ((2, 64, 28, 28), (64, 64, 3, 3), 1, 1, 1, "bias_relu"),
    "3x3_stride_2": ((2, 128, 28, 28), (256, 128, 3, 3), 2, 1, 1, ""),
    "1x1_residual": ((2, 256, 14, 14), (256, 256, 1, 1), 1, 0, 1, "residual"),
    "7x7_stem_3_channels": ((2, 3, 64, 64), (64, 3, 7, 7), 2, 3, 1, "bias_relu"),
    "grouped": ((2, 64, 14, 14), (64, 16, 3, 3), 1, 1, 4, ""),
    "split_sum": ((1, 512, 7, 7), (512, 512, 3, 3), 1, 1, 1, "bias_relu"),
    "edges_padded_channels": ((1, 38, 13, 11), (40, 38, 3, 3), 1, 1, 1, ""),
}


@pytest.mark.parametrize("name", CHANNELS_LAST)
def test_cooperative_channels_last_convolution(name, device, results, rng, monkeypatch):
    needs(device, "cooperative")
    monkeypatch.setattr(conv_kernels, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv_kernels.CHANNELS_LAST_MIN, 0))
    g, want = channels_last_case(CHANNELS_LAST[name], rng)
    # lower, not vkml.compile: the plan cache keys the sources, not the switch set here
    session = Session(lower(g, device.caps, precision="f16").plan, device)
    session.step()
    kernels = [d.kernel.name for d in session.plan.dispatches]
    copies = [k for k in kernels if k.startswith(conv_kernels.CHANNELS_LAST)]
    (conv,) = [k for k in kernels if "conv2d" in k]
    # x's copy, and the weight's but for a pointwise convolution's (read as it is)
    assert len(copies) == (1 if name == "1x1_residual" else 2) and re.search(COOP, conv), \
        kernels
    if name == "split_sum":
        assert any(k.startswith("fused_sum") for k in kernels), kernels
    gate(results, f"cooperative channels-last convolution {name}", kernels,
         {"y": (session.read("y"), want)}, {})
    session.close()


# conv -> bias + ReLU -> conv, the first writing the second's channels-last f16 copy itself
# (compiler/layouts.py store_layouts): its store, or the sum of its split partial sums.
# x shape, middle channels, out channels
CHANNELS_LAST_STORES = {
    "conv_store": ((8, 64, 56, 56), 64, 64),  # tiles enough to fill the GPU unsplit
    "split_sum_store": ((1, 512, 7, 7), 512, 256),
}


@pytest.mark.parametrize("name", CHANNELS_LAST_STORES)
def test_cooperative_channels_last_store(name, device, results, rng, monkeypatch):
    needs(device, "cooperative")
    monkeypatch.setattr(conv_kernels, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv_kernels.CHANNELS_LAST_MIN, 0))
    g, want = chain_case(*CHANNELS_LAST_STORES[name], rng)
    stages = lower(g, device.caps, precision="f16")
    stored = [n.op for n in stages.nodes if n is not None and "store" in n.attrs]
    assert stored == ["fused_sum" if name.startswith("split") else "fused_conv2d"], stored
    session = Session(stages.plan, device)
    session.step()
    kernels = [d.kernel.name for d in session.plan.dispatches]
    convs = [k for k in kernels if "conv2d" in k]
    assert len(convs) == 2 and all(re.search(COOP, k) for k in convs), kernels
    gate(results, f"cooperative channels-last store {name}", kernels,
         {"y": (session.read("y"), want)}, {})
    session.close()


@pytest.mark.parametrize("name", COOPERATIVE_ATTENTION)
def test_cooperative_attention(name, device, results, rng):
    # tests/test_ops.py checks which plans take it; here its values
    needs(device, "cooperative")
    g, operands = cooperative_attention_case(name, rng)
    session, kernels = infer(g, device)
    assert len(kernels) == 1 and kernels[0].startswith("flash_attention") \
        and kernels[0].endswith("_c"), kernels
    want = cooperative_attention_reference(name, [tensor64(x) for x in operands])
    gate(results, f"cooperative attention {name}", kernels,
         {"out": (session.read("out"), numpy64(want))}, {})
    session.close()


PRECISIONS = ("f32", "f16", "bf16")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_special_values(precision, device, results):
    # every op that compares values, at NaN, +-inf and huge values, as float64 torch: NaN,
    # +inf and -inf exactly where torch's are (tests/special_values.py)
    if precision == "bf16":
        needs(device, "bf16")
    if precision == "f16" and dataclasses.replace(device.caps, precision="f16").f16_products \
            is None:
        pytest.skip(f"NOT CHECKED: {device.caps.device_name} has no f16 arithmetic")
    problems, kernels = run_special_values(device, precision)
    results.append({"case": f"special values {precision}", "kernels": kernels,
                    "mismatches": problems, "passed": not problems})
    assert not problems, "\n".join(problems)


# ---- precision="bf16": the cooperative kernels with bfloat16 operands ------------------------
# Each case meets PROTOCOL.md's gates against float64 torch and, more tightly, the kernels'
# arithmetic emulated in float64: every operand of every product rounded to bfloat16 as it is
# staged (8 significant bits), products and sums exact. Vulkan leaves OpFConvert's rounding to
# the implementation (to nearest even, or toward zero), so the case must match the emulation
# under one of them. What is left is the f32 summation: at most about k 2^-24 relative for k
# terms (4.9e-4 at the deepest product here, k = 8192), about sqrt(k) 2^-24 for sums of
# random signs as these are (5e-6); tensor cores need not round each addition as IEEE does,
# but the H200's f16 runs of these cases were all 2.92e-4 to 2.96e-4 from float64, k = 64 to
# 8192, which is f16's rounding alone (its emulation gives 2.94e-4): their sums added well
# under 1e-4. BF16_MODEL_TOL, 2e-4, is 12 times below what bfloat16 rounding costs (2.35e-3
# to nearest, 8 times f16's: three fewer bits), so f16 or f32 operands would fail it as
# surely as wrong ones. Attention rounds its probabilities too, computed in f32 in the kernel
# and in float64 here: those within f32's error of a rounding boundary round the other way,
# one bfloat16 step each, and one step of a large probability moves its row's output much.
# Emulated with f32 scores and softmax on the CPU, 2 of the "edges" case's 45000
# probabilities flipped and moved its output by 1.1e-4 (the other cases by 0); a GPU's
# approximate exp flips a few more. BF16_ATTENTION_MODEL_TOL allows 1e-3,
# still 3 times below what bfloat16 operands cost these cases (2.8e-3 to 3.4e-3 to nearest).
BF16_MODEL_TOL, BF16_ATTENTION_MODEL_TOL = 2e-4, 1e-3
ROUNDINGS = ("nearest", "zero")
# The backward pass's products take cooperative tiles unscaled (bfloat16 has f32's exponent
# range), also below gemm.SCALED_MIN_ROWS rows, where f16 keeps f32 tiles
BF16_BACKWARD = {**BACKWARD, "below_scaled_min_rows": ((128, 384), (384, 640), False, False)}


def bf16(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """x's f32 values converted to bfloat16, to the nearest (even; torch's own conversion) or
    toward zero (the f32's low 16 bits cut), as float64."""
    single = x.detach().to(torch.float32)
    rounded = (single.to(torch.bfloat16).to(torch.float32) if rounding == "nearest"
               else (single.view(torch.int32) & -65536).view(torch.float32))
    return rounded.to(torch.float64)


def bf16_matmul(rounding: str):
    """torch.matmul as the bf16 kernels compute it, forward and backward: each product's two
    operands rounded to bfloat16 (`bf16`), the sums exact."""

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return bf16(a, rounding) @ bf16(b, rounding)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            ga = bf16(grad, rounding) @ bf16(b, rounding).transpose(-1, -2)
            gb = bf16(a, rounding).transpose(-1, -2) @ bf16(grad, rounding)
            return ga.sum_to_size(a.shape), gb.sum_to_size(b.shape)

    return Product.apply


def _products(cases: dict, name: str, ops: dict[str, torch.Tensor], mm=torch.matmul):
    """The products of case `name` of MATMULS or a backward dict, from `ops` by `mm` (y less
    its bias)."""
    if cases[name] is None:  # _read_twice_graph
        return mm(ops["x"], ops["w1"]) + mm(ops["x"], ops["w2"])
    a, b, (ta, tb) = ops["a"], ops["b"], cases[name][2:4]
    return mm(a.transpose(-1, -2) if ta else a, b.transpose(-1, -2) if tb else b)


@pytest.mark.parametrize("name", MATMULS)
def test_bf16_matmul(name, device, results, rng):
    needs(device, "bf16")
    a_shape, b_shape, ta, tb, bias = MATMULS[name]
    g, _, refs, want = _matmul_graph(rng, a_shape, b_shape, ta, tb, bias)
    session, kernels = infer(g, device, "bf16")
    (product,) = products(session, "forward")
    assert re.search(COOP + "$", product), kernels
    exact = _products(MATMULS, name, refs)
    models = {r: {"y": numpy64(want - exact + _products(MATMULS, name, refs, bf16_matmul(r)))}
              for r in ROUNDINGS}
    gate(results, f"bf16 matmul {name}", kernels, {"y": (session.read("y"), numpy64(want))},
         {}, models, BF16_MODEL_TOL)
    session.close()


@pytest.mark.parametrize("name", BF16_BACKWARD)
def test_bf16_matmul_backward_unscaled(name, device, results, rng):
    needs(device, "bf16")
    g, y, refs, want = _case_graph(BF16_BACKWARD, name, rng)
    session, forward, grads, weights = _train(rng, g, y, lambda loss: vkml.compile(
        g, loss=loss, keep_grads=True, precision="bf16", device=device), refs, want)
    backward, forward_products = products(session, "backward"), products(session, "forward")
    assert len(backward) == 2 * len(forward_products) and all(
        re.search(COOP + "$", k) for k in [*backward, *forward_products]), (backward,
                                                                            forward_products)
    assert not any(d.op == "abs_max" for d in session.plan.dispatches)  # nothing scaled
    models = {}
    for rounding in ROUNDINGS:
        ops = {n: tensor64(numpy64(r)) for n, r in refs.items()}
        model = (want.detach() - _products(BF16_BACKWARD, name, refs).detach()
                 + _products(BF16_BACKWARD, name, ops, bf16_matmul(rounding)))
        (model * torch.tensor(weights, dtype=torch.float64, device=REF)).sum().backward()
        models[rounding] = {"y": numpy64(model), **{n: numpy64(o.grad) for n, o in ops.items()}}
    gate(results, f"bf16 matmul backward {name}",
         [d.kernel.name for d in session.plan.dispatches], forward, grads, models,
         BF16_MODEL_TOL)
    session.close()


@pytest.mark.parametrize("name", CONVS)
def test_bf16_convolution(name, device, results, rng):
    needs(device, "bf16")
    g, x, w = _conv_case(name, rng)
    session, kernels = infer(g, device, "bf16")
    _conv_kernel(name, kernels)
    x64, w64 = tensor64(x), tensor64(w)
    models = {r: {"y": numpy64(_conv_reference(name, bf16(x64, r), bf16(w64, r)))}
              for r in ROUNDINGS}
    gate(results, f"bf16 convolution {name}", kernels,
         {"y": (session.read("y"), numpy64(_conv_reference(name, x64, w64)))}, {}, models,
         BF16_MODEL_TOL)
    session.close()


def test_bf16_convolution_weight_gradient(device, results, rng):
    # unscaled, a convolution's weight gradient takes cooperative tiles at precision "bf16"
    # (at "f16" convolutions' gradients stay f32: they have no scaled form)
    needs(device, "bf16")
    x = rng.standard_normal((1, 256, 48, 48)).astype(np.float32)
    w = (rng.standard_normal((2048, 256, 3, 3)) / np.sqrt(256 * 9)).astype(np.float32)
    g = vkml.Graph()
    y = g.output("y", g.conv2d(g.param("x", x.shape, init=x), g.param("w", w.shape, init=w),
                               padding=1))
    weights = (rng.standard_normal(y.shape) * 1e-7).astype(np.float32)
    session = vkml.compile(g, loss=g.sum(g.mul(y, g.constant(weights))), keep_grads=True,
                           trainable=["w"], precision="bf16", device=device)
    session.step()
    kernels = [d.kernel.name for d in session.plan.dispatches]
    assert any(re.search(r"^conv2d_weight_grad.*" + COOP + "$", k) for k in kernels), kernels
    assert any(re.search(r"^conv2d_\d.*" + COOP + "$", k) for k in kernels), kernels
    x64, w64, dy = tensor64(x), tensor64(w), torch.tensor(weights, dtype=torch.float64,
                                                         device=REF)

    def outcome(round_=lambda t: t):
        return (numpy64(F.conv2d(round_(x64), round_(w64), padding=1)),
                numpy64(torch.nn.grad.conv2d_weight(round_(x64), w.shape, round_(dy),
                                                    padding=1)))
    want_y, want_w = outcome()
    models = {}
    for rounding in ROUNDINGS:
        model_y, model_w = outcome(lambda t, r=rounding: bf16(t, r))
        models[rounding] = {"y": model_y, "w": model_w}
    gate(results, "bf16 convolution weight gradient", kernels,
         {"y": (session.read("y"), want_y)}, {"w": (session.grad("w"), want_w)}, models,
         BF16_MODEL_TOL)
    session.close()


def _bf16_attention_model(name: str, operands: list[np.ndarray], rounding: str
                          ) -> torch.Tensor:
    """The cooperative attention kernel's arithmetic in float64 (kernels/attention.py
    `_cooperative`): Q times the scale in f32, then rounded to bfloat16, K and V rounded, the
    scores exact, the probabilities normalized then rounded, their product with V exact."""
    causal, inner = COOPERATIVE_ATTENTION[name][1], name in HEADS_INNER
    q, k, v = (torch.tensor(x, device=REF) for x in operands)  # float32, as held
    if inner:
        q, k, v = (x.permute(SWAP_HEADS) for x in (q, k, v))
    scale = torch.tensor(1.0 / math.sqrt(q.shape[-1]), dtype=torch.float32, device=REF)
    rep = q.shape[1] // k.shape[1]  # query heads per key head
    q = bf16(q * scale, rounding)
    k, v = (bf16(x, rounding).repeat_interleave(rep, dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2)
    if causal:  # top-left aligned: query i sees keys j <= i
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=REF).triu(diagonal=1)
        scores = scores.masked_fill(above, -math.inf)
    out = bf16(torch.softmax(scores, dim=-1), rounding) @ v
    return out.permute(SWAP_HEADS) if inner else out


@pytest.mark.parametrize("name", COOPERATIVE_ATTENTION)
def test_bf16_attention(name, device, results, rng):
    needs(device, "bf16")
    g, operands = cooperative_attention_case(name, rng)
    session, kernels = infer(g, device, "bf16")
    assert len(kernels) == 1 and kernels[0].startswith("flash_attention") \
        and kernels[0].endswith("_c"), kernels
    want = cooperative_attention_reference(name, [tensor64(x) for x in operands])
    models = {r: {"out": numpy64(_bf16_attention_model(name, operands, r))} for r in ROUNDINGS}
    gate(results, f"bf16 attention {name}", kernels,
         {"out": (session.read("out"), numpy64(want))}, {}, models, BF16_ATTENTION_MODEL_TOL)
    session.close()
