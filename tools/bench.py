"""vkml against PyTorch on the same GPU in one run: the five workloads of vkml/models/ x
{training step (Adam), inference} x {strict f32, accelerated}, with PROTOCOL.md's gates.

    python tools/bench.py                          # full configs: every workload, phase and mode
    python tools/bench.py --tiny                   # tiny configs (lavapipe, PyTorch on the CPU)
    python tools/bench.py --only smollm2,resnet --phases train --modes strict --reps 20
    python tools/bench.py --backend wgpu           # the vkml rows through the wgpu backend
    python tools/bench.py --matmul                 # also one n^3 matmul vs cuBLAS, TFLOP/s
    python tools/bench.py --session-order          # only: sessions one after another (below)
    python tools/bench.py --only resnet --torch-engines all   # + torch.compile, torchvision's

Engines, per (workload, phase, mode):
- vkml: `vkml.compile(...)` (strict: the default precision, f32; accelerated: `precision="f16"`,
  or `--vkml-accel bf16` for bfloat16 cooperative matrices). A build without the keyword, or
  a device that cannot run it, gives a row marked "not available" with the reason.
- torch-eager: the plain-PyTorch twin of tests/torch_reference.py, torch.optim.Adam defaults.
- torch-graphs: the same step captured whole in one CUDA graph (Adam capturable=True, warm-up on a
  side stream, zero_grad(set_to_none=True), then forward + backward + opt.step() captured;
  inference captured under no_grad). Skipped, with the reason, where PyTorch has no CUDA device.
- torch-compile: the module compiled by torch.compile (`--torch-compile-backend`, Inductor by
  default, default mode), then the whole step captured in one CUDA graph as above; compile_s is
  its first call. Without CUDA it runs compiled, uncaptured (cuda_graph false).
- hf-eager, hf-graphs, hf-compile: the same three with what a PyTorch user runs instead of the
  plain reference, for the three workloads that have one (tools/bench_hf.py): Hugging Face
  LlamaForCausalLM with SDPA (SmolLM2), torchvision's ResNet (ResNet-50), Hugging Face
  WhisperForAudioClassification with SDPA (Whisper), loaded from the same weights file.
`--torch-engines` picks among these (default eager,graphs; "all": every one). Strict: TF32 off for
cuBLAS and cuDNN. Accelerated: TF32 on, and each engine again with autocast of the forward for
every type of `--torch-autocast` (default none,bf16: rows "torch-eager+bf16" ...; f32 master
weights, cache_enabled=False; no loss scaling, so f16 training is a timing, not a recipe). Without
CUDA (`--tiny` here: lavapipe), PyTorch runs on the CPU with one thread, and its graph and
accelerated rows are recorded as skipped / not available, with the reason. Every PyTorch row
carries PROTOCOL.md's gates against the plain reference in float64 (the markdown's "Every PyTorch
row" table, where there are engines beyond eager and graphs).

Same weights and inputs on both sides: each workload's seeded parameters go into one safetensors
file, written once and loaded by name by every vkml session and every PyTorch module. The
training step runs Adam(lr=1e-4) on both. Inference computes the outputs AND the loss on both
sides (PyTorch's reference forward returns both), so the work is the same. ResNet-50's inference
uses batch norm's inference form (running statistics, seeded non-trivial values in the file).

Figures per row:
- median_ms / min_ms / n: wall clock of `step(); wait()` (vkml) or of the step followed by
  `torch.cuda.synchronize()` (PyTorch), after `--warmup` untimed steps, over `--reps` steps.
- gpu_ms: device time: vkml `session.profile(reps)` (timestamps after every dispatch; `source`
  says whether they were plausible or the host timed it), CUDA events around each PyTorch step.
- gates (PROTOCOL.md): against PyTorch in float64 on the same device, same weights and inputs:
  forward rel L2 of every output and the loss < 1%; gradient-norm error, total and per parameter,
  < 5%; per-parameter cosine > 0.99; NaN/Inf anywhere fails. Training-step gates come from a
  gradient session (loss, no optimizer) of the same graph and precision; inference gates from
  the timed inference session itself. PyTorch's own rows carry the same figures for context
  (its f32/TF32 result against float64).
- compile (vkml): cold = a fresh subprocess with an empty VKML_CACHE_DIR and empty driver shader
  caches (Mesa, NVIDIA); warm = another fresh subprocess on the directories the cold one filled.
  The shipped SPIR-V (spirv/) is used in both, as on a user's first run. `in_bench_s` is the
  bench process's own compile, on the user's caches in whatever state they are.
- memory: vkml's planned physical (and logical) bytes; PyTorch's torch.cuda.max_memory_allocated
  over the row (weights, gradients, optimizer state, activations, graph pool), above what was
  allocated before it.
- ratios (markdown, JSON "ratios"): vkml's median wall time over each PyTorch engine's.
- --matmul: C = A @ B with A, B (n x n, random normal) as vkml parameters, so a step is the
  product alone (inputs would be copied from staging memory every step); GPU time from
  profile(); PyTorch torch.mm at fp32 (TF32 off), TF32, f16 and bf16, CUDA events; TFLOP/s at the
  median (and best) time, relative error against float64.

--session-order (a run of its own): per workload, the sessions f32 train, f16 train, f16 infer,
f32 infer (SESSION_ORDER) compiled, stepped and closed one after another on the bench's device,
each beside the same session alone in a fresh process (the graph's seeded weights, the same
inputs and steps): a session whose steady time (after WARMUP_S of steps) is more than 1.2x its
time alone is flagged. Its first steps are timed apart with the GPU's SM clock before them: a
session compiled after an f16 training session once read 3-4x slower than alone, which was the
GPU's clock after the idle compile, not the session (tools/clock_lab.py). Each entry also
records the GPU time (`profile()`) here and alone, which tells a slower device (memory,
clocks) from a slower host (waits, threads), the loss here and alone, the device's live
buffers (count, bytes) and heap budget after the close, and how many of the session's arenas
were host-mapped memory.

Order, for a run cut short by a time limit: each workload's rows (timings and gates), then the
matmul, then the compile subprocesses; the JSON is rewritten after every row, the markdown after
every workload, the chart at the end (also on SIGTERM). `--budget-s` stops starting new work past
that many seconds and records what was skipped. Output: out/results/bench-<UTC time>-<config>-
<backend>.{json,md,png} (out/ is not committed: copy a run's files into tools/results/ when the
README or tools/KERNELS.md cites it); a short summary table is printed last. `--redraw RUN.json`
makes a saved run's markdown and chart again from its JSON (tools/results/ keeps the JSON and
markdown of the runs it cites, without their charts).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import gc
import inspect
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # torch_reference.py, the plain-PyTorch twins

LR = 1e-4
PHASES = ("train", "infer")
MODES = ("strict", "accelerated")
# PyTorch's engines (--torch-engines): the plain references of tests/torch_reference.py eager,
# in one CUDA graph, and torch.compile'd in one CUDA graph; "hf-": the same three for the Hugging
# Face / torchvision twin (tools/bench_hf.py) where the workload has one.
TORCH_ENGINES = ("eager", "graphs", "compile", "hf-eager", "hf-graphs", "hf-compile")
AUTOCASTS = ("none", "bf16", "f16")
# PROTOCOL.md's gates
FORWARD_TOL, GRAD_TOL, COSINE_MIN = 1e-2, 5e-2, 0.99
MiB = 2**20
# --session-order: the order in which, on the H200, a session compiled after an f16 training
# session in the same process read 3-4x slower than alone (its first steps, at idle clocks); a
# session whose steady time is this much slower than in a fresh process is flagged.
SESSION_ORDER = (("strict", "train"), ("accelerated", "train"), ("accelerated", "infer"),
                 ("strict", "infer"))
SLOWER_THAN_FRESH = 1.2


# ---- workloads ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    module: str  # in vkml.models
    full: Callable[[Any], Any]  # the models module -> its full config
    tiny: Callable[[Any], Any]
    reference: str  # the class in tests/torch_reference.py
    infer_overrides: dict[str, Any] = field(default_factory=dict)  # config for inference

    def config(self, tiny: bool, phase: str) -> Any:
        import vkml.models

        mod = getattr(vkml.models, self.module)
        cfg = (self.tiny if tiny else self.full)(mod)
        return replace(cfg, **self.infer_overrides) if phase == "infer" else cfg

    def build(self, tiny: bool, phase: str) -> Any:
        import vkml.models

        return getattr(vkml.models, self.module).build(self.config(tiny, phase))


WORKLOADS = {w.name: w for w in [
    Workload("smollm2", "smollm2", lambda m: m.SmolLM2Config(), lambda m: m.tiny(), "SmolLM2"),
    Workload("smolvla_expert", "smolvla_expert", lambda m: m.SmolVLAExpertConfig(),
             lambda m: m.tiny(), "SmolVLAExpert"),
    Workload("unet", "unet", lambda m: m.UNetConfig(), lambda m: m.tiny(), "UNet"),
    # ResNet-50; inference uses batch norm's inference form (running statistics), as deployed
    Workload("resnet", "resnet", lambda m: m.resnet50(), lambda m: m.tiny("bottleneck"),
             "ResNet", {"bn": "eval"}),
    Workload("whisper_encoder", "whisper_encoder", lambda m: m.WhisperEncoderConfig(),
             lambda m: m.tiny(), "WhisperForAudioClassification"),
]}


class NotAvailable(Exception):
    """A row that cannot run here, for a stated reason (recorded, never silently skipped)."""

    status = "not available"


class Skipped(NotAvailable):
    """A row this machine has no means to run (CUDA graphs without CUDA)."""

    status = "skipped"


# ---- small helpers ------------------------------------------------------------------------------
def stats(samples_ms: list[float]) -> dict[str, Any]:
    if not samples_ms:
        return {"median": None, "min": None, "n": 0}
    return {"median": statistics.median(samples_ms), "min": min(samples_ms), "n": len(samples_ms)}


def error_text(exc: BaseException) -> str:
    """One line for a row's reason: the exception and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}{where}"[:500]


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64).ravel()
    want = np.asarray(want, np.float64).ravel()
    if got.shape != want.shape:
        return math.inf
    denom = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / (denom if denom > 0 else 1.0)


def gates(forward: dict[str, np.ndarray], ref_forward: dict[str, np.ndarray],
          grads: Callable[[str], np.ndarray] | None = None,
          ref_grads: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """PROTOCOL.md's forward (and, given gradients, backward) gates of one result against the
    float64 reference. `grads(name)` fetches one gradient at a time: SmolLM2's are 0.5 GB."""
    out: dict[str, Any] = {"forward_rel_l2": {}, "nonfinite": []}
    failed = []
    for name, want in ref_forward.items():
        got = np.asarray(forward[name])
        if not np.all(np.isfinite(got)):
            out["nonfinite"].append(name)
        err = rel_l2(got, want)
        out["forward_rel_l2"][name] = err
        if not err < FORWARD_TOL:
            failed.append(f"forward {name} {err:.2e}")
    if grads is not None and ref_grads is not None:
        total = ref_total = 0.0
        worst, cos_min = ("", 0.0), ("", 1.0)
        for name, want in ref_grads.items():
            got = np.asarray(grads(name), np.float64).ravel()
            want = want.ravel()
            if not np.all(np.isfinite(got)):
                out["nonfinite"].append(f"grad {name}")
            gn, wn = float(np.linalg.norm(got)), float(np.linalg.norm(want))
            total, ref_total = total + gn * gn, ref_total + wn * wn
            err = abs(gn - wn) / wn if wn > 0 else gn
            cos = float(got @ want) / (gn * wn) if gn > 0 and wn > 0 else float(gn == wn)
            if not err <= worst[1]:
                worst = (name, err)
            if not cos >= cos_min[1]:
                cos_min = (name, cos)
        total_err = abs(math.sqrt(total) - math.sqrt(ref_total)) / math.sqrt(ref_total)
        out.update(grad_total_norm_error=total_err, grad_param_norm_error_worst=list(worst),
                   grad_cosine_min=list(cos_min))
        if not total_err < GRAD_TOL:
            failed.append(f"grad total norm {total_err:.2e}")
        if not worst[1] < GRAD_TOL:
            failed.append(f"grad norm {worst[0]} {worst[1]:.2e}")
        if not cos_min[1] > COSINE_MIN:
            failed.append(f"cosine {cos_min[0]} {cos_min[1]:.4f}")
    if out["nonfinite"]:
        failed.append("NaN/Inf in " + ", ".join(out["nonfinite"][:5]))
    out["failed"] = failed
    out["pass"] = not failed
    return out


def gate_text(g: dict[str, Any] | None) -> str:
    if not g:
        return "-"
    fwd = max(g["forward_rel_l2"].values(), default=0.0)
    text = f"fwd {fwd:.1e}"
    if "grad_total_norm_error" in g:
        text += (f", grad {g['grad_param_norm_error_worst'][1]:.1e}, "
                 f"cos {g['grad_cosine_min'][1]:.4f}")
    return ("pass" if g["pass"] else "FAIL") + f" ({text})"


def git_commit() -> str:
    """The checkout's commit ("-dirty" where tracked files differ from it) and the sha256 of
    vkml's sources, which the plan cache keys on: a copy of the checkout whose git metadata is
    stale (the lent GPU's copy keeps the session's first index) still names the code that ran.
    `python -c "from vkml.compiler.plan_cache import source_fingerprint as f; print(f()[:12])"`
    gives it for any checkout."""
    from vkml.compiler.plan_cache import source_fingerprint

    sources = f"sources {source_fingerprint()[:12]}"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}{'-dirty' if dirty else ''}, {sources}"
    except (OSError, subprocess.SubprocessError):
        return f"unknown commit (no git metadata in this copy), {sources}"


def nvidia_smi() -> dict[str, str]:
    """Read-only query of the GPU's name, driver and clocks (nothing is changed)."""
    fields = "name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(fields.split(","), (v.strip() for v in out.splitlines()[0].split(","))))


def cache_env(root: Path) -> dict[str, str]:
    """Every cache a compile can hit, as new empty directories under `root`: vkml's (SPIR-V,
    naga's compiled wasm, the VkPipelineCache) and the drivers' shader disk caches (Mesa's and
    NVIDIA's; Mesa turns its cache off when the directory is missing)."""
    dirs = {"VKML_CACHE_DIR": root / "vkml", "MESA_SHADER_CACHE_DIR": root / "mesa",
            "__GL_SHADER_DISK_CACHE_PATH": root / "nvidia"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {"__GL_SHADER_DISK_CACHE": "1", **{k: str(v) for k, v in dirs.items()}}


# ---- vkml ---------------------------------------------------------------------------------------
def session_args(vkml: Any, built: Any, phase: str) -> dict[str, Any]:
    """What vkml.compile gets for a phase: "train" (Adam step), "grad" (gradients, for the
    gates), "infer" (outputs and the loss, as PyTorch's reference forward computes both)."""
    if phase == "train":
        return {"loss": built.loss, "optimizer": vkml.Adam(lr=LR), "outputs": built.outputs}
    if phase == "grad":
        return {"loss": built.loss, "outputs": built.outputs}
    return {"outputs": {**built.outputs, "loss": built.loss}}


def vkml_compile(vkml: Any, graph: Any, device: Any, mode: str, accel: str,
                 **kwargs: Any) -> Any:
    """vkml.compile at the mode's precision; NotAvailable where this build or device cannot."""
    if mode == "accelerated":
        if "precision" not in inspect.signature(vkml.compile).parameters:
            raise NotAvailable("vkml.compile has no precision= keyword in this build")
        kwargs["precision"] = accel
    try:
        return vkml.compile(graph, device=device, **kwargs)
    except TypeError as e:
        if "precision" in str(e):
            raise NotAvailable(f"vkml.compile(precision={accel!r}): {e}") from e
        raise
    except vkml.VkmlError as e:
        if mode == "accelerated":
            raise NotAvailable(f"precision={accel!r} on this device: {error_text(e)}") from e
        raise


def load_weights(session: Any, path: Path) -> None:
    """The shared file, by name. Not strict: the file is the union of the train and inference
    graphs' parameters (ResNet's inference form adds running statistics); every parameter the
    session has must be in it."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        names = set(f.keys())
    missing = sorted(set(session.plan.params) - names)
    if missing:
        raise RuntimeError(f"the weights file lacks {missing[:5]}")
    session.load(path, strict=False, optimizer_state=False)  # the file holds none


def profile_summary(profile: Any) -> dict[str, Any]:
    """Step times from `session.profile()`, and every kernel that ran (PROTOCOL.md: a result
    records which kernels ran) as [name, calls per step, ms per step], slowest first."""
    steps = max(getattr(profile, "steps", 1), 1)
    rows = sorted(getattr(profile, "rows", []), key=lambda r: -r.total_ms)
    return {**stats(list(profile.step_ms)), "source": profile.source,
            "note": getattr(profile, "note", ""),
            "per_kernel": [[r.name, r.calls // steps, r.total_ms / steps] for r in rows]}


def child_compile(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process (caches chosen by the parent's environment): build one workload's
    graph and compile one session, timing each part."""
    t0 = time.perf_counter()
    import vkml

    t1 = time.perf_counter()
    device = vkml.Device(backend=spec["backend"])
    t2 = time.perf_counter()
    built = WORKLOADS[spec["workload"]].build(spec["tiny"], spec["phase"])
    t3 = time.perf_counter()
    try:
        session = vkml_compile(vkml, built.graph, device, spec["mode"], spec["accel"],
                               **session_args(vkml, built, spec["phase"]))
    except NotAvailable as e:
        device.close()
        return {"status": "not available", "reason": str(e)}
    t4 = time.perf_counter()
    kernels = getattr(session, "kernel_count", None)
    session.close()
    device.close()  # writes the pipeline cache a warm run reads
    return {"status": "ok", "import_s": t1 - t0, "device_s": t2 - t1, "build_s": t3 - t2,
            "compile_s": t4 - t3, "close_s": time.perf_counter() - t4, "kernels": kernels}


# The least time spent warming up before timing. On the H200 a vkml session's first 0.15-0.4 s
# of steps ran up to 3x slow on a device that had run other sessions, whatever the count.
WARMUP_S = 1.0


def timed_calls(call: Callable[[], Any], warmup: int, reps: int,
                warmup_s: float = WARMUP_S) -> dict[str, Any]:
    """The first call, `warmup` more and as many as fill `warmup_s` seconds, then `reps` timed
    calls, wall clock in ms."""
    t0 = time.perf_counter()
    call()
    first = (time.perf_counter() - t0) * 1e3
    done = 0
    while done < warmup or time.perf_counter() - t0 < warmup_s:
        call()
        done += 1
    wall = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        wall.append((time.perf_counter() - t0) * 1e3)
    # in order: a session slow at first and fast later shows here, not in the median
    return {**stats_fields(wall), "first_step_ms": first, "wall_ms": wall}


def timed_steps(session: Any, warmup: int, reps: int,
                warmup_s: float = WARMUP_S) -> dict[str, Any]:
    """timed_calls of `step(); wait()`."""
    def step() -> None:
        session.step()
        session.wait()

    return timed_calls(step, warmup, reps, warmup_s)


def device_state(device: Any) -> dict[str, Any]:
    """What a closed session should leave as it found it: the backend's live objects (and
    their bytes), and what VK_EXT_memory_budget says this process may still allocate in the
    heap vkml's buffers go to (None where the driver does not say); once the sessions dropped
    without close() are freed, which the next compile would do (so "before" is not more)."""
    gc.collect()
    device.release_dropped()
    return {"live": device.backend.live_objects(),
            "heap_available_bytes": device.backend.device_memory().available}


def time_session(vkml: Any, device: Any, built: Any, phase: str, mode: str, accel: str,
                 arrays: dict[str, np.ndarray], warmup: int, reps: int,
                 warmup_s: float = WARMUP_S) -> dict[str, Any]:
    """--session-order's measure of one session, the same in the bench process and in a fresh
    one: compile (the graph's seeded initial weights), time its first `warmup` + `reps` steps
    (`step(); wait()`) and read the loss there (a count, so both runs' losses are comparable),
    then `reps` more after stepping for `warmup_s`: the steady time the ratio is taken of. The
    GPU's SM clock (nvidia-smi) is read before the first step and after the steady steps:
    on the H200 a GPU idle for about half a second (a compile) drops from 1980 to 345 MHz and
    a session's first 0.15-0.4 s run 3-4x slower until it climbs back
    (tools/clock_lab.py). Also the device's state before the compile and after the close, and
    how many of the session's arenas landed in host-mapped memory."""
    before = device_state(device)
    t0 = time.perf_counter()
    session = vkml_compile(vkml, built.graph, device, mode, accel,
                           **session_args(vkml, built, phase))
    compile_s = time.perf_counter() - t0
    try:
        for name, value in arrays.items():
            session.set_input(name, value)
        clock_first = nvidia_smi().get("clocks.sm")
        first = timed_steps(session, warmup, reps, warmup_s=0.0)
        loss = float(np.asarray(session.read("loss")).ravel()[0])
        out = timed_steps(session, 0, reps, warmup_s)
        out["first_steps"] = {k: first[k] for k in ("median_ms", "min_ms", "first_step_ms",
                                                    "wall_ms")}
        out["clocks_sm"] = {"before_first_step": clock_first,
                            "after_steady_steps": nvidia_smi().get("clocks.sm")}
        # device time apart from wall time: a session slower on the GPU (memory, clocks) or
        # only on the host (waits, threads) after another
        gpu = profile_summary(session.profile(reps))
        out["gpu_ms"] = {k: gpu[k] for k in ("median", "min", "n", "source")}
        out["loss"] = loss
        arenas = getattr(getattr(session, "_bound", None), "arenas", [])
        out["arenas_mapped"] = [sum(getattr(a, "pointer", None) is not None for a in arenas),
                                len(arenas)]
        out["physical_bytes"] = session.plan.memory.physical_bytes
    finally:
        session.close()
    return {"status": "ok", "compile_s": compile_s, **out, "device_before": before,
            "device_after_close": device_state(device)}


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one --session-order session, alone."""
    import vkml

    device = vkml.Device(backend=spec["backend"])
    try:
        built = WORKLOADS[spec["workload"]].build(spec["tiny"], spec["phase"])
        arrays = built.sample_inputs(np.random.default_rng(spec["seed"]))
        return time_session(vkml, device, built, spec["phase"], spec["mode"], spec["accel"],
                            arrays, spec["warmup"], spec["reps"], spec["warmup_s"])
    except NotAvailable as e:
        return {"status": "not available", "reason": str(e)}
    finally:
        device.close()


# ---- PyTorch ------------------------------------------------------------------------------------
TORCH_FACTORIES = ("arange", "ones", "zeros", "full", "empty", "eye", "linspace", "rand",
                   "randn", "tensor")


def _on_device(factory: Callable[..., Any], device: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("device", device)
    return factory(*args, **kwargs)


def reference_models(torch: Any, device: Any) -> types.ModuleType:
    """tests/torch_reference.py, its numerics untouched. It builds RoPE tables and causal masks
    with factory calls (torch.arange, torch.ones) that default to the CPU, which on a GPU would
    mix host and device tensors, and copy from the host inside a CUDA-graph capture. The module
    is handed a `torch` whose factories default to the bench's device instead: unlike
    torch.set_default_device (a TorchFunctionMode), that adds no Python work to every op of the
    eager baseline."""
    import torch_reference

    if device.type != "cpu":
        proxy = types.ModuleType("torch")
        proxy.__dict__.update(vars(torch))
        for name in TORCH_FACTORIES:
            setattr(proxy, name, functools.partial(_on_device, getattr(torch, name), device))
        torch_reference.torch = proxy  # type: ignore[attr-defined]
    return torch_reference


class TorchSide:
    """PyTorch on the bench's device: precision modes, modules from the shared weights, timing
    of eager steps and of CUDA-graph replays, peak memory."""

    def __init__(self, device: str, compile_backend: str = "inductor") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.autocast = "none"  # "none", "bf16" or "f16": accelerated mode's autocast, per row
        self.compile_backend = compile_backend  # torch.compile's backend for the compile rows
        if not self.cuda:
            # One thread: PyTorch's OpenMP workers otherwise spin against a CPU Vulkan driver's
            # threads on the same cores (seen on a 2-core machine with lavapipe and wgpu: a tiny
            # SmolLM2 step went from 4 ms to 0.2-1.3 s).
            torch.set_num_threads(1)
        self.ref = reference_models(torch, self.device)
        self.mode = "strict"

    # precision ---------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> str:
        """Set TF32 for the mode; returns the label recorded in the rows."""
        torch = self.torch
        if not self.cuda:
            if mode == "accelerated":
                raise NotAvailable("TF32 and CUDA autocast need a CUDA device; PyTorch runs on "
                                   f"the {self.device.type} here")
            self.mode = mode
            return "fp32"
        value = "tf32" if mode == "accelerated" else "ieee"
        backends = torch.backends
        if hasattr(backends.cuda.matmul, "fp32_precision"):
            # The fp32_precision API (PyTorch >= 2.9) only: reading or setting the legacy
            # allow_tf32 flags as well raises once the new ones are set.
            for flags in (backends.cuda.matmul, backends.cudnn.conv,
                          getattr(backends.cudnn, "rnn", None)):
                if hasattr(flags, "fp32_precision"):
                    flags.fp32_precision = value
        else:
            backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = value == "tf32"
        self.mode = mode
        if mode == "strict":
            return "fp32 (TF32 off: cuBLAS and cuDNN)"
        return "TF32 (cuBLAS and cuDNN)" + (f" + autocast {self.autocast}"
                                            if self.autocast != "none" else "")

    def _autocast(self) -> Any:
        torch = self.torch
        if self.mode != "accelerated" or self.autocast == "none":
            return torch.autocast(self.device.type, enabled=False)
        dtype = torch.bfloat16 if self.autocast == "bf16" else torch.float16
        # cache_enabled=False: autocast's weight-cast cache must be off inside graph capture
        return torch.autocast(self.device.type, dtype=dtype, cache_enabled=False)

    # modules and data --------------------------------------------------------------------------
    def template(self, workload: Workload, cfg: Any, weights: Path, infer: bool,
                 library: bool = False) -> Any:
        """The reference module (or, `library`, its Hugging Face / torchvision twin from
        tools/bench_hf.py) on the device with the shared weights, loaded by name; every row
        copies it."""
        from safetensors.torch import load_file

        if library:
            import bench_hf

            module = bench_hf.twin(workload.name, cfg)
            # its parameters come from the file; buffers the file lacks (torchvision's running
            # statistics beside a training graph, which has none) keep the library's values
            required = [n for n, _ in module.named_parameters()]
        else:
            module = getattr(self.ref, workload.reference)(cfg)
            required = [k for k in module.state_dict() if not k.endswith("num_batches_tracked")]
        own = module.state_dict()
        loaded = load_file(str(weights))
        missing = [k for k in required if k not in loaded]
        if missing:
            raise RuntimeError(f"the weights file lacks {missing[:5]}")
        module.load_state_dict({k: v for k, v in loaded.items() if k in own}, strict=False)
        # .float(): the references are written for float64 tests and compute some buffers in
        # float64 (Whisper's positions), which would otherwise promote the f32 model
        module = module.float().to(self.device)
        if library:  # as a user runs it: eval() for inference
            return module.train(not infer)
        return module.eval() if infer and workload.infer_overrides else module

    def inputs(self, arrays: dict[str, np.ndarray], float64: bool = False) -> dict[str, Any]:
        torch = self.torch
        out = {}
        for k, v in arrays.items():
            t = torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
            out[k] = t.double() if float64 and t.is_floating_point() else t
        return out

    def forward(self, module: Any, x: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        with self._autocast():
            return module(**x)

    def results(self, module: Any, x: dict[str, Any], grads: bool) -> tuple[
            dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """One forward (and backward) from the module's current weights: outputs and loss, and
        every parameter's gradient, as float64 numpy."""
        torch = self.torch
        module.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grads):
            outputs, loss = self.forward(module, x)
        # to the host first, then float64: a float64 copy on the device would count in the
        # eager row's peak memory
        fwd = {k: v.detach().cpu().double().numpy() for k, v in outputs.items()}
        fwd["loss"] = loss.detach().cpu().double().numpy()
        if not grads:
            return fwd, None
        loss.backward()
        g = {n: p.grad.cpu().double().numpy() for n, p in module.named_parameters()
             if p.requires_grad}  # frozen ones (Whisper's positions) have none
        module.zero_grad(set_to_none=True)
        return fwd, g

    def reference(self, template: Any, arrays: dict[str, np.ndarray], grads: bool) -> tuple[
            dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """The gates' reference: the same module in float64 on the same device."""
        mode, self.mode = self.mode, "strict"  # no autocast in the reference
        try:
            module = copy.deepcopy(template).double()
            return self.results(module, self.inputs(arrays, float64=True), grads)
        finally:
            self.mode = mode
            self.release()

    # timing and memory -------------------------------------------------------------------------
    def release(self) -> int:
        """Free what earlier rows left; returns the bytes still allocated (the row's base)."""
        gc.collect()
        if not self.cuda:
            return 0
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak(self, base: int) -> dict[str, Any]:
        if not self.cuda:
            return {"torch_peak_bytes": None, "note": "PyTorch on the CPU: no allocator peak"}
        return {"torch_peak_bytes": self.torch.cuda.max_memory_allocated() - base}

    def timed(self, fn: Callable[[], Any], warmup: int, reps: int) -> dict[str, Any]:
        """First call, `warmup` more, then `reps` timed calls: wall clock to synchronization,
        and CUDA-event time on the GPU."""
        torch, cuda = self.torch, self.cuda
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first = (time.perf_counter() - t0) * 1e3
        for _ in range(warmup):
            fn()
        sync()
        wall, gpu = [], []
        for _ in range(reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            if cuda:
                end.record()
            sync()
            wall.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                gpu.append(start.elapsed_time(end))
        return {**stats_fields(wall), "first_step_ms": first,
                "gpu_ms": {**stats(gpu), "source": "CUDA events"} if cuda else None}

    def compiled(self, module: Any, compile: bool) -> Any:
        """`module`, compiled in place by torch.compile where `compile` (parameter names kept,
        where torch.compile(module) would prefix them)."""
        if compile:
            # A fresh start per row: Dynamo's caches are per code object, and the rows' copies
            # of one model (each mode and phase) would otherwise add up to its recompile limit,
            # past which it runs the model uncompiled without a word
            self.torch._dynamo.reset()
            module.compile(backend=self.compile_backend)
        return module

    def checked(self, module: Any, x: dict[str, Any], phase: str,
                reference: tuple[dict, dict | None]) -> tuple[dict[str, Any], float]:
        """PyTorch's own error at this precision against float64, for context; also the first
        call (a compiled module's compile): its seconds."""
        t0 = time.perf_counter()
        fwd, grads = self.results(module, x, grads=phase == "train")
        first_s = time.perf_counter() - t0
        return gates(fwd, reference[0], grads.__getitem__ if grads else None,
                     reference[1]), first_s

    def eager(self, template: Any, arrays: dict[str, np.ndarray], phase: str, warmup: int,
              reps: int, reference: tuple[dict, dict | None],
              compile: bool = False) -> dict[str, Any]:
        torch = self.torch
        base = self.release()
        module = self.compiled(copy.deepcopy(template), compile)
        x = self.inputs(arrays)
        check, first_s = self.checked(module, x, phase, reference)
        if phase == "train":
            opt = torch.optim.Adam(module.parameters(), lr=LR)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                self.forward(module, x)[1].backward()
                opt.step()
        else:
            def step() -> None:
                with torch.no_grad():
                    self.forward(module, x)
        out = self.timed(step, warmup, reps)
        out.update(memory=self.peak(base), gates=check)
        if compile:
            out.update(compile_s=first_s, cuda_graph=False,
                       compile_backend=self.compile_backend)
        return out

    def graphs(self, template: Any, arrays: dict[str, np.ndarray], phase: str, warmup: int,
               reps: int, reference: tuple[dict, dict | None],
               compile: bool = False) -> dict[str, Any]:
        """The whole step captured in one CUDA graph and replayed; `compile`: torch.compile's
        module in it (its compile, the first call, timed apart as compile_s)."""
        if not self.cuda:
            if compile:  # torch.compile still runs, without the capture
                return self.eager(template, arrays, phase, warmup, reps, reference, True)
            raise Skipped(f"CUDA graphs need a CUDA device; PyTorch runs on the "
                          f"{self.device.type} here")
        torch = self.torch
        base = self.release()
        module = self.compiled(copy.deepcopy(template), compile)
        x = self.inputs(arrays)  # static inputs: the graph reads these buffers every replay
        check, first_s = self.checked(module, x, phase, reference)
        torch.cuda.reset_peak_memory_stats()  # the row's peak: the captured step's
        t0 = time.perf_counter()  # capture_s: warm-up and capture
        train = phase == "train"
        opt = torch.optim.Adam(module.parameters(), lr=LR, capturable=True) if train else None

        def body() -> Any:
            if opt is None:
                with torch.no_grad():
                    return self.forward(module, x)[1]
            loss = self.forward(module, x)[1]
            loss.backward()
            opt.step()
            return loss

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: cuBLAS, Adam's state
            for _ in range(max(warmup, 3)):
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if opt is not None:
            opt.zero_grad(set_to_none=True)  # gradients then live in the graph's pool
        with torch.cuda.graph(graph):
            loss = body()
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0
        out = self.timed(graph.replay, warmup, reps)
        finite = bool(torch.isfinite(loss).item())
        out.update(memory=self.peak(base), capture_s=capture_s, loss_finite=finite,
                   gates=check)
        if compile:
            out.update(compile_s=first_s, cuda_graph=True, compile_backend=self.compile_backend)
        return out

    def matmul(self, a: np.ndarray, b: np.ndarray, precision: str, warmup: int,
               reps: int) -> dict[str, Any]:
        torch = self.torch
        if precision != "fp32" and not self.cuda:
            raise NotAvailable(f"{precision} matmul: measured on CUDA only (PyTorch runs on "
                               f"the {self.device.type} here)")
        self.set_mode("accelerated" if precision == "tf32" else "strict")
        ta, tb = self.inputs({"a": a, "b": b}).values()
        if precision in ("f16", "bf16"):
            dtype = torch.float16 if precision == "f16" else torch.bfloat16
            ta, tb = ta.to(dtype), tb.to(dtype)
        c = torch.empty((a.shape[0], b.shape[1]), dtype=ta.dtype, device=self.device)
        out = self.timed(lambda: torch.mm(ta, tb, out=c), warmup, reps)
        out["result"] = c.double().cpu().numpy()
        return out


# ---- the run ------------------------------------------------------------------------------------
class Report:
    """The run's JSON, markdown and chart; the JSON is rewritten after every change."""

    def __init__(self, stem: Path, meta: dict[str, Any]) -> None:
        self.stem, self.meta = stem, meta
        self.rows: list[dict[str, Any]] = []
        self.matmul: list[dict[str, Any]] = []
        self.sessions: list[dict[str, Any]] = []  # --session-order
        self.lock = threading.Lock()  # compile subprocesses report from worker threads
        stem.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict[str, Any], matmul: bool = False) -> dict[str, Any]:
        (self.matmul if matmul else self.rows).append(row)
        status = row["status"] + (f": {row['reason']}" if row.get("reason") else "")
        what = (f"matmul {row['size']} {row['engine']} {row['precision']}" if matmul else
                f"{row['workload']} {row['phase']} {row['mode']} {row['engine']}")
        timing = f" {row['median_ms']:.3f} ms" if row.get("median_ms") is not None else ""
        print(f"  {what}:{timing} {status}", flush=True)
        self.save()
        return row

    def add_session(self, entry: dict[str, Any]) -> None:
        self.sessions.append(entry)
        what = f"  {entry['position']}. {entry['workload']} {entry['phase']} {entry['precision']}"
        if entry["status"] != "ok":
            print(f"{what}: {entry['status']}: {entry.get('reason', '')}", flush=True)
        else:
            fresh = entry["fresh_process"]
            alone = (f"{fresh['median_ms']:.3f} ms alone" if fresh.get("status") == "ok"
                     else f"alone: {fresh.get('status')}: {fresh.get('reason', '')}")
            flag = " SLOWER" if entry.get("slower") else ""
            print(f"{what}: {entry['in_process']['median_ms']:.3f} ms here, {alone}{flag}",
                  flush=True)
        self.save()

    def session_table(self) -> list[str]:
        if not self.sessions:
            return []
        lines = ["| workload | # | phase | precision | here ms (steady) | fresh process ms | "
                 "here / fresh | GPU ms here / fresh | first steps here / fresh ms | SM MHz "
                 "at the first step here / fresh | loss here vs fresh | arenas mapped | device "
                 "after close: buffers, MiB, heap available MiB |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def first(r: dict[str, Any]) -> str:
            f = r.get("first_steps") or {}
            return f"{f['median_ms']:.3g}" if "median_ms" in f else "-"

        def clock(r: dict[str, Any]) -> str:
            return str((r.get("clocks_sm") or {}).get("before_first_step") or "-")

        def ms(r: dict[str, Any]) -> str:
            if r.get("status") != "ok":
                return f"{r.get('status')}: {r.get('reason', '')}"[:200]
            return f"{r['median_ms']:.3g} ({r['min_ms']:.3g})"

        for e in self.sessions:
            head = f"| {e['workload']} | {e['position']} | {e['phase']} | {e['precision']} |"
            if e["status"] != "ok":
                lines.append(f"{head} {e['status']}: {e.get('reason', '')[:200]} | | | | | | | | |")
                continue
            here, fresh = e["in_process"], e["fresh_process"]
            ratio = (f"**{e['ratio']:.2f}x**" if e.get("slower") else f"{e['ratio']:.2f}x"
                     ) if "ratio" in e else "-"
            loss = f"{e['loss_rel_diff']:.1e}" if "loss_rel_diff" in e else "-"
            after = here["device_after_close"]
            avail = after["heap_available_bytes"]
            state = (f"{after['live']['buffers']}, {after['live']['buffer_bytes'] / MiB:.3g}, "
                     + ("-" if avail is None else f"{avail / MiB:.0f}"))
            gpu = " / ".join("-" if not (r.get("gpu_ms") or {}).get("median") else
                             f"{r['gpu_ms']['median']:.3g}" for r in (here, fresh))
            lines.append(f"{head} {ms(here)} | {ms(fresh)} | {ratio} | {gpu} | "
                         f"{first(here)} / {first(fresh)} | {clock(here)} / {clock(fresh)} | "
                         f"{loss} | "
                         f"{here['arenas_mapped'][0]} / {here['arenas_mapped'][1]} | {state} |")
        return lines

    def find(self, workload: str, phase: str, mode: str, engine: str) -> dict[str, Any] | None:
        for r in self.rows:
            if (r["workload"], r["phase"], r["mode"], r["engine"]) == (workload, phase, mode,
                                                                         engine):
                return r
        return None

    def save(self) -> None:
        with self.lock:
            data = {"meta": self.meta, "rows": self.rows, "matmul": self.matmul,
                    "ratios": self.ratios()}
            if self.sessions:
                data["session_order"] = self.sessions
            tmp = self.stem.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
            os.replace(tmp, self.stem.with_suffix(".json"))

    def groups(self) -> Iterator[tuple[str, str, str]]:
        seen = []
        for r in self.rows:
            key = (r["workload"], r["phase"], r["mode"])
            if key not in seen:
                seen.append(key)
        yield from seen

    def ratios(self) -> list[dict[str, Any]]:
        """vkml over each PyTorch engine, on median wall time, per (workload, phase, mode)."""
        out = []
        for wl, phase, mode in self.groups():
            v = self.find(wl, phase, mode, self.meta["vkml_engine"])
            entry: dict[str, Any] = {"workload": wl, "phase": phase, "mode": mode}
            for engine in self.torch_engines():
                t = self.find(wl, phase, mode, engine)
                ok = v and t and v.get("median_ms") and t.get("median_ms")
                key = f"vkml/{engine.removeprefix('torch-')}"
                entry[key] = v["median_ms"] / t["median_ms"] if ok else None
            out.append(entry)
        return out

    def torch_engines(self) -> list[str]:
        """PyTorch's engines in the rows, in order: eager and graphs always (the main table's
        columns), then any other (torch.compile, the library twins, autocast variants)."""
        vk = self.meta["vkml_engine"]
        engines = ["torch-eager", "torch-graphs"]
        for r in self.rows:
            if r["engine"] not in engines and r["engine"] != vk:
                engines.append(r["engine"])
        return engines

    def engines_table(self) -> list[str]:
        """Every PyTorch row, where the run has engines beyond eager and graphs: time, vkml's
        time over it, its gates against float64 and its compile time."""
        if self.torch_engines() == ["torch-eager", "torch-graphs"]:
            return []
        vk = self.meta["vkml_engine"]
        lines = ["| workload | phase | mode | engine | precision | ms | vkml / this | "
                 "GPU ms | gates | compile s | peak MiB |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for wl, phase, mode in self.groups():
            v = self.find(wl, phase, mode, vk)
            for engine in self.torch_engines():
                r = self.find(wl, phase, mode, engine)
                if r is None:
                    continue
                head = f"| {wl} | {phase} | {mode} | {engine} |"
                if r["status"] != "ok":
                    lines.append(f"{head} | {r['status']} | | | | | |")
                    continue
                ratio = (f"{v['median_ms'] / r['median_ms']:.2f}x"
                         if v and v.get("median_ms") else "-")
                gpu = (r.get("gpu_ms") or {}).get("median")
                comp = r.get("compile_s")
                peak = (r.get("memory") or {}).get("torch_peak_bytes")
                lines.append(
                    f"{head} {r.get('precision', '')} | {r['median_ms']:.3g} ({r['min_ms']:.3g})"
                    f" | {ratio} | {'-' if gpu is None else f'{gpu:.3g}'} | "
                    f"{gate_text(r.get('gates'))} | {'-' if comp is None else f'{comp:.1f}'} | "
                    f"{'-' if not peak else f'{peak / MiB:.3g}'} |")
        return lines

    def table(self) -> list[str]:
        vk = self.meta["vkml_engine"]
        lines = ["| workload | phase | mode | vkml ms | eager ms | graphs ms | vkml/eager | "
                 "vkml/graphs | vkml GPU ms | gates (vkml) | compile cold / warm s | "
                 "memory vkml / eager / graphs MiB |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def ms(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            if r["status"] != "ok":
                return r["status"]
            return f"{r['median_ms']:.3g} ({r['min_ms']:.3g})"

        def ratio(x: float | None) -> str:
            return f"{x:.2f}x" if x else "-"

        def mib(r: dict[str, Any] | None, key: str) -> str:
            value = (r or {}).get("memory", {}).get(key)
            return f"{value / MiB:.3g}" if value else "-"

        for entry in self.ratios():
            wl, phase, mode = entry["workload"], entry["phase"], entry["mode"]
            v = self.find(wl, phase, mode, vk)
            eager = self.find(wl, phase, mode, "torch-eager")
            graphs = self.find(wl, phase, mode, "torch-graphs")
            gpu = (v or {}).get("gpu_ms") or {}
            gpu_text = (f"{gpu['median']:.3g}" + ("" if gpu["source"] == "gpu timestamps"
                                                  else " (host)")) if gpu.get("median") else "-"
            comp = (v or {}).get("compile", {})
            cold, warm = comp.get("cold_s"), comp.get("warm_s")
            comp_text = " / ".join("-" if x is None else f"{x:.2f}" for x in (cold, warm))
            mem = f"{mib(v, 'physical_bytes')} / {mib(eager, 'torch_peak_bytes')} / " \
                  f"{mib(graphs, 'torch_peak_bytes')}"
            lines.append(f"| {wl} | {phase} | {mode} | {ms(v)} | {ms(eager)} | {ms(graphs)} | "
                         f"{ratio(entry['vkml/eager'])} | {ratio(entry['vkml/graphs'])} | "
                         f"{gpu_text} | {gate_text((v or {}).get('gates'))} | {comp_text} | "
                         f"{mem} |")
        return lines

    def matmul_table(self) -> list[str]:
        if not self.matmul:
            return []
        lines = ["| n | engine | precision | GPU ms median (min) | TFLOP/s (best) | rel err |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for r in self.matmul:
            if r["status"] != "ok":
                lines.append(f"| {r['size']} | {r['engine']} | {r['precision']} | "
                             f"{r['status']}: {r.get('reason', '')} | - | - |")
                continue
            g = r["gpu_ms"]
            lines.append(f"| {r['size']} | {r['engine']} | {r['precision']} | {g['median']:.3g} "
                         f"({g['min']:.3g}) | {r['tflops']:.3g} ({r['tflops_best']:.3g}) | "
                         f"{r['rel_err']:.1e} |")
        return lines

    def write_markdown(self) -> Path:
        m = self.meta
        lines = [f"# vkml bench, {m['date']}", "",
                 f"- GPU: {m['gpu']}; driver {m['driver']}; vkml device {m['vkml_device']}",
                 f"- PyTorch {m['torch']} on {m['torch_device']}; vkml {m['vkml_commit']}, "
                 f"backend {m['backend']}; configs: {m['config']}",
                 f"- {m['warmup']} warm-up + {m['reps']} timed steps per row. Times: median (min)"
                 " ms, wall clock to completion; ratios on medians, measured in this run. "
                 "vkml GPU ms: device timestamps ('host' where they were not plausible).",
                 f"- strict: {m['precision']['strict']}; accelerated: "
                 f"{m['precision']['accelerated']}", ""]
        if self.rows or not self.sessions:
            lines += [*self.table(), ""]
        engines = self.engines_table()
        if engines:
            lines += ["## Every PyTorch row", "", "torch-: the plain references "
                      "(tests/torch_reference.py); hf-: Hugging Face transformers (SmolLM2, "
                      "Whisper) and torchvision (ResNet-50) with the same weights "
                      "(tools/bench_hf.py); graphs: the whole step in one CUDA graph; compile: "
                      f"{self.meta.get('torch_compile', 'torch.compile')}. Gates: against the "
                      "plain reference in float64.", "", *engines, ""]
        if self.sessions:
            lines += ["## Sessions one after another in one process", "",
                      f"Compiled and timed in this order on one device, each beside the same "
                      f"session alone in a fresh process (median (min) ms); bold: more than "
                      f"{SLOWER_THAN_FRESH}x slower here.", "", *self.session_table(), ""]
        if self.matmul:
            lines += ["## One n^3 matmul", "", *self.matmul_table(), ""]
        by_reason: dict[str, list[str]] = {}  # one line per reason, naming its rows
        for r in self.rows:
            if r["status"] != "ok":
                by_reason.setdefault(f"{r['status']}: {r.get('reason', '')}", []).append(
                    f"{r['workload']} {r['phase']} {r['mode']} {r['engine']}")
        notes = [f"- {reason} ({', '.join(rows)})" for reason, rows in by_reason.items()]
        notes += [f"- {r['workload']} {r['phase']} {r['mode']} vkml gates failed: "
                  + "; ".join(r["gates"]["failed"]) for r in self.rows
                  if r.get("gates") and not r["gates"]["pass"] and r["engine"].startswith("vkml")]
        if notes:
            lines += ["## Not run, not available, failed", "", *notes, ""]
        path = self.stem.with_suffix(".md")
        path.write_text("\n".join(lines))
        return path

    def write_chart(self) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            self.meta["chart"] = f"not written: {e}"
            return None
        engines = (self.meta["vkml_engine"], *self.torch_engines())
        modes = [m for m in MODES if any(r["mode"] == m and r["status"] == "ok"
                                         for r in self.rows)]
        panels = len(modes) + bool(self.matmul)
        if not panels:
            return None
        fig, axes = plt.subplots(panels, 1, figsize=(12, 3.8 * panels), squeeze=False)
        for ax, mode in zip(axes[:, 0], modes):
            keys = [(wl, ph) for wl, ph, md in self.groups() if md == mode]
            x = np.arange(len(keys))
            width = 0.8 / len(engines)
            for i, engine in enumerate(engines):
                rows = [self.find(wl, ph, mode, engine) for wl, ph in keys]
                heights = [r["median_ms"] if r and r.get("median_ms") else np.nan for r in rows]
                bars = ax.bar(x + (i - (len(engines) - 1) / 2) * width, heights, width,
                              label=engine)
                ax.bar_label(bars, fmt="%.3g", fontsize=7)
            ax.set_xticks(x, ["\n".join([*wl.split("_"), ph]) for wl, ph in keys], fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("ms per step (median)")
            ax.set_title(f"{mode}: {self.meta['precision'][mode]}", fontsize=10)
            ax.legend(fontsize=8)
        if self.matmul:
            ax = axes[-1, 0]
            ok = [r for r in self.matmul if r["status"] == "ok"]
            labels = sorted({f"{r['engine']} {r['precision']}" for r in ok})
            sizes = sorted({r["size"] for r in ok})
            x = np.arange(len(sizes))
            width = 0.8 / max(len(labels), 1)
            for i, label in enumerate(labels):
                vals = [next((r["tflops"] for r in ok if r["size"] == n and
                              f"{r['engine']} {r['precision']}" == label), np.nan)
                        for n in sizes]
                bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, vals, width, label=label)
                ax.bar_label(bars, fmt="%.3g", fontsize=7)
            ax.set_xticks(x, [f"{n}^3" for n in sizes])
            ax.set_ylabel("TFLOP/s (median)")
            ax.set_title("one matmul", fontsize=10)
            ax.legend(fontsize=8)
        fig.suptitle(f"vkml vs PyTorch, {self.meta['gpu']}, {self.meta['date']}", fontsize=11)
        fig.tight_layout()
        path = self.stem.with_suffix(".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


class Bench:
    def __init__(self, opts: argparse.Namespace, tmp: Path) -> None:
        self.opts, self.tmp = opts, tmp
        self.start = time.perf_counter()
        import vkml

        self.vkml = vkml
        self.device = vkml.Device(backend=opts.backend)
        self.engine = "vkml" if opts.backend == "vulkan" else f"vkml-{opts.backend}"
        torch_device = opts.torch_device
        if torch_device == "auto":
            import torch

            torch_device = "cuda" if torch.cuda.is_available() else "cpu"
        self.torch = TorchSide(torch_device, opts.torch_compile_backend)
        torch = self.torch.torch
        caps = self.device.caps
        smi = nvidia_smi()
        gpu = (torch.cuda.get_device_name() if self.torch.cuda else
               f"{self.device.name} (no CUDA: PyTorch on the CPU)")
        now = dt.datetime.now(dt.timezone.utc)
        precision = {}
        for mode in MODES:
            try:
                precision[mode] = f"vkml {'f32' if mode == 'strict' else opts.vkml_accel}; " \
                                  f"PyTorch {self.torch.set_mode(mode)}"
            except NotAvailable as e:
                precision[mode] = f"vkml {opts.vkml_accel}; PyTorch: {e}"
        casts = [c for c in opts.torch_autocast if c != "none"]
        if casts:
            precision["accelerated"] += "; " + ", ".join(
                f"rows '+{c}': the same with autocast to {c} (f32 weights)" for c in casts)
        self.torch.set_mode("strict")
        meta = {
            "date": now.isoformat(timespec="seconds"), "host": platform.node(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "note": opts.note,
            "gpu": gpu, "driver": smi.get("driver_version") or getattr(caps, "driver", "?"),
            "nvidia_smi_at_start": smi, "vkml_device": repr(self.device),
            "vkml_driver": getattr(caps, "driver", None), "backend": opts.backend,
            "vkml_engine": self.engine, "vkml_commit": git_commit(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "torch_device": str(self.torch.device), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "compile_jobs": opts.compile_jobs,
            "vkml_wait_timeout_s": os.environ.get("VKML_WAIT_TIMEOUT"),
            "numpy": np.__version__, "config": "tiny" if opts.tiny else "full",
            "reps": opts.reps, "warmup": opts.warmup, "optimizer": f"Adam(lr={LR})",
            "precision": precision, "torch_engines": opts.torch_engines,
            "torch_compile": f"torch.compile(backend={opts.torch_compile_backend!r}), default "
                             "mode; on CUDA the whole step then captured in one CUDA graph; "
                             "compile_s: its first call (one step)",
            "gates": {"forward_rel_l2_max": FORWARD_TOL, "grad_norm_error_max": GRAD_TOL,
                      "cosine_min": COSINE_MIN, "reference": f"PyTorch float64 on "
                      f"{self.torch.device}, same weights and inputs"},
            "timing": "median_ms/min_ms/n: wall clock, step to completion; gpu_ms: vkml "
                      "profile() timestamps / CUDA events. Warm-up steps untimed.",
            "compile": "cold: fresh process, empty VKML_CACHE_DIR and driver shader caches; "
                       "warm: fresh process on what the cold run left; shipped SPIR-V used",
        }
        stem = f"bench-{now.strftime('%Y%m%d-%H%M%S')}-{meta['config']}-{opts.backend}"
        if opts.session_order:
            stem += "-sessions"
        self.report = Report(Path(opts.out_dir) / stem, meta)
        self.compile_jobs: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> str | None:
        budget = self.opts.budget_s
        if budget and self.elapsed() > budget:
            return f"--budget-s {budget:g} s reached ({self.elapsed():.0f} s into the run)"
        return None

    def row(self, workload: str, phase: str, mode: str, engine: str,
            **fields: Any) -> dict[str, Any]:
        return {"workload": workload, "phase": phase, "mode": mode, "engine": engine,
                "config": self.report.meta["config"], **fields}

    def guarded(self, base: dict[str, Any], fn: Callable[[], dict[str, Any]],
                matmul: bool = False) -> dict[str, Any]:
        """Run one row; any failure becomes the row's status and reason, and the run goes on."""
        try:
            return self.report.add({**base, "status": "ok", **fn()}, matmul)
        except NotAvailable as e:
            return self.report.add({**base, "status": e.status, "reason": str(e)}, matmul)
        except Exception as e:  # noqa: BLE001 - one broken row must not end a one-shot run
            traceback.print_exc()
            return self.report.add({**base, "status": "failed", "reason": error_text(e)}, matmul)

    # workloads ---------------------------------------------------------------------------------
    def workload(self, wl: Workload) -> None:
        """Every row of one workload; if preparing it fails (graph, weights, PyTorch reference),
        its rows say so and the run goes on with the next workload."""
        try:
            skip = self.over_budget()
            if skip:
                self.fill(wl, "skipped", skip)
            else:
                self.workload_rows(wl)
        except Exception as e:  # noqa: BLE001 - one broken workload must not end the run
            traceback.print_exc()
            self.fill(wl, "failed", error_text(e))
        finally:
            (self.tmp / f"{wl.name}.safetensors").unlink(missing_ok=True)
            self.torch.release()
            self.report.write_markdown()

    def fill(self, wl: Workload, status: str, reason: str, mode: str | None = None) -> None:
        """Rows of `wl` (in `mode`, or all modes) not recorded yet, with a status and reason."""
        for md in [mode] if mode else self.opts.modes:
            for ph in self.opts.phases:
                engines = [self.engine, *(e for e, _, _ in self.torch_engines(wl, md))]
                for engine in engines:
                    if self.report.find(wl.name, ph, md, engine) is None:
                        self.report.add(self.row(wl.name, ph, md, engine, status=status,
                                                 reason=reason))

    def workload_rows(self, wl: Workload) -> None:
        opts = self.opts
        print(f"{wl.name}: building", flush=True)
        built: dict[str, Any] = {}
        for ph in opts.phases:  # inference compiles the training graph unless its config differs
            same = ph == "infer" and "train" in built and not wl.infer_overrides
            built[ph] = built["train"] if same else wl.build(opts.tiny, ph)
        cfgs = {ph: wl.config(opts.tiny, ph) for ph in opts.phases}
        arrays = next(iter(built.values())).sample_inputs(np.random.default_rng(opts.seed))
        weights = self.write_weights(wl, built)
        t = self.torch
        templates = {ph: t.template(wl, cfgs[ph], weights, ph == "infer") for ph in opts.phases}
        library: dict[str, Any] = {}  # the Hugging Face / torchvision twin, or why none
        if any(kind.startswith("hf-") for md in opts.modes
               for _, kind, _ in self.torch_engines(wl, md)):
            for ph in opts.phases:
                try:
                    library[ph] = t.template(wl, cfgs[ph], weights, ph == "infer", library=True)
                except Exception as e:  # noqa: BLE001 - its rows say why; the others run
                    traceback.print_exc()
                    library[ph] = NotAvailable(f"the library twin: {error_text(e)}")
        refs = {}
        for ph in opts.phases:
            if ph == "infer" and "train" in refs and not wl.infer_overrides:
                refs[ph] = (refs["train"][0], None)  # the same forward
            else:
                refs[ph] = t.reference(templates[ph], arrays, grads=ph == "train")
        for mode in opts.modes:
            skip = self.over_budget()
            if skip:
                self.fill(wl, "skipped", skip, mode)
                continue
            for ph in opts.phases:
                self.phase(wl, ph, mode, built[ph], arrays, weights, templates[ph],
                           library.get(ph), refs[ph])

    def write_weights(self, wl: Workload, built: dict[str, Any]) -> Path:
        """One safetensors file per workload: the seeded initial parameters of its graphs;
        batch norm running statistics (inference form) set to seeded non-trivial values, so
        that form is not an identity."""
        from safetensors.numpy import save_file

        weights: dict[str, np.ndarray] = {}
        for b in built.values():
            for name, t in b.graph.params.items():
                weights.setdefault(name, b.graph.initial_values[t.id])
        rng = np.random.default_rng(self.opts.seed + 1)
        for name in sorted(weights):
            if name.endswith("running_mean"):
                weights[name] = (rng.standard_normal(weights[name].shape) * 0.1).astype(
                    np.float32)
            elif name.endswith("running_var"):
                weights[name] = rng.uniform(0.5, 2.0, weights[name].shape).astype(np.float32)
        path = self.tmp / f"{wl.name}.safetensors"
        save_file(weights, str(path))
        return path

    def torch_engines(self, wl: Workload, mode: str) -> list[tuple[str, str, str]]:
        """(row engine, --torch-engines kind, autocast) of PyTorch's rows of `wl` in `mode`:
        strict runs without autocast; accelerated once per --torch-autocast (TF32 on in each),
        the engine named with "+bf16" / "+f16" where autocast is on."""
        import bench_hf

        autocasts = ["none"] if mode == "strict" else self.opts.torch_autocast
        return [(("" if kind.startswith("hf-") else "torch-") + kind
                 + ("" if cast == "none" else f"+{cast}"), kind, cast)
                for cast in autocasts for kind in self.opts.torch_engines
                if not kind.startswith("hf-") or wl.name in bench_hf.WORKLOADS]

    def phase(self, wl: Workload, phase: str, mode: str, built: Any,
              arrays: dict[str, np.ndarray], weights: Path, template: Any, library: Any,
              ref: tuple[dict, dict | None]) -> None:
        t = self.torch
        vk = self.guarded(self.row(wl.name, phase, mode, self.engine,
                                   settings=asdict(wl.config(self.opts.tiny, phase))),
                          lambda: self.vkml_row(built, phase, mode, arrays, weights, ref))
        if vk["status"] == "ok":
            self.compile_jobs.append({"workload": wl.name, "phase": phase, "mode": mode,
                                      "tiny": self.opts.tiny, "backend": self.opts.backend,
                                      "accel": self.opts.vkml_accel})
        warmup, reps = self.opts.warmup, self.opts.reps

        def run(kind: str) -> dict[str, Any]:
            module = library if kind.startswith("hf-") else template
            if isinstance(module, NotAvailable):
                raise module
            how = kind.removeprefix("hf-")
            if how == "eager":
                return t.eager(module, arrays, phase, warmup, reps, ref)
            return t.graphs(module, arrays, phase, warmup, reps, ref, compile=how == "compile")

        for engine, kind, cast in self.torch_engines(wl, mode):
            t.autocast = cast
            try:
                label = t.set_mode(mode)
            except NotAvailable as e:
                self.report.add(self.row(wl.name, phase, mode, engine, status="not available",
                                         reason=str(e)))
                continue
            self.guarded(self.row(wl.name, phase, mode, engine, precision=label),
                         functools.partial(run, kind))
        t.autocast = "none"
        t.set_mode("strict")

    def vkml_row(self, built: Any, phase: str, mode: str, arrays: dict[str, np.ndarray],
                 weights: Path, ref: tuple[dict, dict | None]) -> dict[str, Any]:
        vkml, opts = self.vkml, self.opts
        t0 = time.perf_counter()
        session = vkml_compile(vkml, built.graph, self.device, mode, opts.vkml_accel,
                               **session_args(vkml, built, phase))
        compile_s = time.perf_counter() - t0
        try:
            load_weights(session, weights)
            for name, value in arrays.items():
                session.set_input(name, value)
            out: dict[str, Any] = {
                "precision": "f32" if mode == "strict" else opts.vkml_accel,
                **self.vkml_timing(session),
                "memory": {"physical_bytes": session.plan.memory.physical_bytes,
                           "logical_bytes": session.plan.memory.logical_bytes},
                "compile": {"in_bench_s": compile_s},
                "dispatches": len(session.plan.dispatches),
                "kernels": getattr(session, "kernel_count", None)}
            if phase == "infer":
                out["gates"] = gates({n: session.read(n) for n in ref[0]}, ref[0])
                return out
            loss = float(np.asarray(session.read("loss")).ravel()[0])
        finally:
            session.close()
        out["loss_after_steps"] = loss
        out["gates"] = self.grad_gates(built, mode, arrays, weights, ref)
        if not math.isfinite(loss):
            out["gates"]["nonfinite"].append("training loss")
            out["gates"]["failed"].append("training loss not finite")
            out["gates"]["pass"] = False
        return out

    def vkml_timing(self, session: Any) -> dict[str, Any]:
        """First step, warm-up, timed `step(); wait()`, then `profile()` for GPU time."""
        out = timed_steps(session, self.opts.warmup, self.opts.reps)
        return {**out, "gpu_ms": profile_summary(session.profile(self.opts.reps))}

    def grad_gates(self, built: Any, mode: str, arrays: dict[str, np.ndarray], weights: Path,
                   ref: tuple[dict, dict | None]) -> dict[str, Any]:
        """A training session's gradients are not kept (their memory is reused), and keeping
        them changes the memory plan being measured: the gates use a gradient session."""
        vkml = self.vkml
        session = vkml_compile(vkml, built.graph, self.device, mode, self.opts.vkml_accel,
                               **session_args(vkml, built, "grad"))
        try:
            load_weights(session, weights)
            for name, value in arrays.items():
                session.set_input(name, value)
            session.step()
            session.wait()
            out = gates({n: session.read(n) for n in ref[0]}, ref[0], session.grad, ref[1])
            out["source"] = "gradient session (loss, no optimizer), same graph and precision"
            return out
        finally:
            session.close()

    # matmul ------------------------------------------------------------------------------------
    def matmul(self) -> None:
        for n in self.opts.matmul_sizes:
            self.matmul_size(n, self.over_budget())
            self.torch.set_mode("strict")

    def matmul_size(self, n: int, skip: str | None) -> None:
        """One n^3 product, vkml (each mode) and PyTorch (fp32, TF32, f16), on the same data;
        GPU time, TFLOP/s at the median and best time, relative error against float64."""
        opts, vkml, t = self.opts, self.vkml, self.torch
        rng = np.random.default_rng(opts.seed + n)
        a = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)
        ta, tb = t.inputs({"a": a, "b": b}, float64=True).values()
        want = (ta @ tb).cpu().numpy()
        del ta, tb

        def done(r: dict[str, Any], c: np.ndarray, gpu: dict[str, Any]) -> dict[str, Any]:
            flop = 2.0 * n**3
            r.update(size=n, gpu_ms=gpu, rel_err=rel_l2(c, want),
                     tflops=flop / (gpu["median"] * 1e-3) / 1e12,
                     tflops_best=flop / (gpu["min"] * 1e-3) / 1e12)
            return r

        def run_vkml(mode: str) -> dict[str, Any]:
            # a and b are parameters: they stay on the device, so the step is the product
            # alone (inputs would be copied from staging memory every step)
            g = vkml.Graph()
            c = g.param("a", a.shape, a) @ g.param("b", b.shape, b)
            s = vkml_compile(vkml, g, self.device, mode, opts.vkml_accel, outputs={"c": c})
            try:
                out = self.vkml_timing(s)
                return done(out, s.read("c"), out.pop("gpu_ms"))
            finally:
                s.close()

        def run_torch(precision: str) -> dict[str, Any]:
            out = t.matmul(a, b, precision, opts.warmup, opts.reps)
            result = out.pop("result")
            gpu = out.pop("gpu_ms") or {"median": out["median_ms"], "min": out["min_ms"],
                                        "n": out["n"], "source": "wall clock (CPU)"}
            return done(out, result, gpu)

        runs: list[tuple[dict[str, Any], Callable[[], dict[str, Any]]]] = [
            ({"engine": self.engine, "precision": "f32" if m == "strict" else opts.vkml_accel},
             functools.partial(run_vkml, m)) for m in opts.modes]
        runs += [({"engine": "torch (cuBLAS)" if t.cuda else "torch (CPU)", "precision": p},
                  functools.partial(run_torch, p)) for p in ("fp32", "tf32", "f16", "bf16")]
        for base, run in runs:
            base = {"size": n, **base}
            if skip:
                self.report.add({**base, "status": "skipped", "reason": skip}, matmul=True)
            else:
                self.guarded(base, run, matmul=True)

    # compile times -----------------------------------------------------------------------------
    def compile_times(self) -> None:
        """Cold then warm compile of every session that ran, each in a fresh process."""
        kinds = {"both": ("cold", "warm"), "cold": ("cold",), "none": ()}[self.opts.compile]
        if not kinds or not self.compile_jobs:
            return
        print(f"compile times ({', '.join(kinds)}), {len(self.compile_jobs)} sessions, "
              f"{self.opts.compile_jobs} at a time", flush=True)

        def one(spec: dict[str, Any]) -> None:
            row = self.report.find(spec["workload"], spec["phase"], spec["mode"], self.engine)
            assert row is not None
            comp = row.setdefault("compile", {})
            cache = Path(tempfile.mkdtemp(prefix="compile-", dir=self.tmp))
            try:
                for kind in kinds:
                    skip = self.over_budget()
                    if skip:
                        comp[f"{kind}_note"] = skip
                        break
                    result = run_child(spec, cache_env(cache))
                    if result.get("status") == "ok":
                        comp[f"{kind}_s"] = result["compile_s"]
                    comp[f"{kind}_detail"] = result
                    print(f"  compile {kind} {spec['workload']} {spec['phase']} {spec['mode']}: "
                          + (f"{result['compile_s']:.2f} s" if "compile_s" in result
                             else str(result)), flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
                self.report.save()

        with ThreadPoolExecutor(self.opts.compile_jobs) as pool:
            list(pool.map(one, self.compile_jobs))

    # sessions one after another -----------------------------------------------------------
    def session_order(self, wl: Workload) -> None:
        """SESSION_ORDER's sessions of `wl` compiled and timed one after another on the bench's
        device, each beside the same session alone in a fresh process (same weights, inputs
        and steps); a ratio past SLOWER_THAN_FRESH is flagged, a loss that differs noted."""
        opts = self.opts
        built: dict[str, Any] = {}
        print(f"{wl.name}: sessions one after another", flush=True)
        for position, (mode, phase) in enumerate(SESSION_ORDER, start=1):
            precision = "f32" if mode == "strict" else opts.vkml_accel
            entry: dict[str, Any] = {"workload": wl.name, "position": position, "mode": mode,
                                     "phase": phase, "precision": precision}
            skip = self.over_budget()
            if skip:
                self.report.add_session({**entry, "status": "skipped", "reason": skip})
                continue
            try:
                if phase not in built:
                    built[phase] = wl.build(opts.tiny, phase)
                arrays = built[phase].sample_inputs(np.random.default_rng(opts.seed))
                here = time_session(self.vkml, self.device, built[phase], phase, mode,
                                    opts.vkml_accel, arrays, opts.warmup, opts.reps,
                                    opts.session_warmup_s)
            except NotAvailable as e:
                self.report.add_session({**entry, "status": e.status, "reason": str(e)})
                continue
            except Exception as e:  # noqa: BLE001 - the next session still tells something
                traceback.print_exc()
                self.report.add_session({**entry, "status": "failed", "reason": error_text(e)})
                continue
            fresh = run_child({"task": "time", "workload": wl.name, "tiny": opts.tiny,
                               "phase": phase, "mode": mode, "accel": opts.vkml_accel,
                               "backend": opts.backend, "seed": opts.seed,
                               "warmup": opts.warmup, "reps": opts.reps,
                               "warmup_s": opts.session_warmup_s}, {})
            entry.update(status="ok", in_process=here, fresh_process=fresh)
            if fresh.get("status") == "ok":
                ratio = here["median_ms"] / fresh["median_ms"]
                loss_diff = abs(here["loss"] - fresh["loss"]) / max(abs(fresh["loss"]), 1e-30)
                entry.update(ratio=ratio, slower=ratio > SLOWER_THAN_FRESH,
                             loss_rel_diff=loss_diff)
            self.report.add_session(entry)
        self.report.write_markdown()

    def finish(self) -> None:
        r = self.report
        r.meta["elapsed_s"] = self.elapsed()
        r.meta["validation_messages"] = list(
            getattr(getattr(self.device, "backend", None), "validation_messages", []))[:20]
        r.meta["nvidia_smi_at_end"] = nvidia_smi()
        r.save()
        md = r.write_markdown()
        png = r.write_chart()
        r.save()
        print(f"\nwrote {r.stem.with_suffix('.json')}\n      {md}\n      {png or '(no chart)'}")
        print(f"{r.meta['gpu']}, {r.meta['config']} configs, backend {r.meta['backend']}, "
              f"{r.meta['elapsed_s']:.0f} s; median (min) ms, wall clock")
        if r.rows:
            print("\n".join(r.table()))
        if r.sessions:
            print("\n".join(r.session_table()))
        if r.matmul:
            print("\n".join(r.matmul_table()))


def stats_fields(wall_ms: list[float]) -> dict[str, Any]:
    s = stats(wall_ms)
    return {"median_ms": s["median"], "min_ms": s["min"], "n": s["n"]}


def run_child(spec: dict[str, Any], env_extra: dict[str, str]) -> dict[str, Any]:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, **env_extra, "PYTHONPATH": path}
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": "compile subprocess timed out (600 s)"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"status": "failed", "reason": last[:500]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def names(allowed: Iterable[str]) -> Callable[[str], list[str]]:
        allowed = list(allowed)

        def parse(text: str) -> list[str]:
            if text.strip() == "all":
                return allowed
            chosen = [s.strip() for s in text.split(",") if s.strip()]
            bad = [s for s in chosen if s not in allowed]
            if bad or not chosen:
                raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {allowed}")
            return [a for a in allowed if a in chosen]  # the canonical order
        return parse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the models' tiny() configs")
    p.add_argument("--only", type=names(WORKLOADS), default=list(WORKLOADS),
                   help=f"workloads, comma-separated: {','.join(WORKLOADS)}")
    p.add_argument("--phases", type=names(PHASES), default=list(PHASES),
                   help="train,infer (default both)")
    p.add_argument("--modes", type=names(MODES), default=list(MODES),
                   help="strict,accelerated (default both)")
    p.add_argument("--reps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--backend", choices=("vulkan", "wgpu"), default="vulkan",
                   help="vkml's backend for the vkml rows")
    p.add_argument("--vkml-accel", choices=("f16", "bf16"), default="f16",
                   help="vkml precision= in accelerated mode (bf16: where the device has "
                        "bfloat16 cooperative matrices, else its rows say not available)")
    p.add_argument("--torch-autocast", type=names(AUTOCASTS), default=["none", "bf16"],
                   help="accelerated PyTorch's rows: TF32, then each again with autocast to "
                   "these types (engines named '+bf16'); default none,bf16")
    p.add_argument("--torch-engines", type=names(TORCH_ENGINES), default=["eager", "graphs"],
                   help=f"PyTorch's engines, comma-separated, or all: {','.join(TORCH_ENGINES)}"
                   " (default eager,graphs: Inductor takes up to a minute or two per compile "
                   "row on a GPU machine)")
    p.add_argument("--torch-compile-backend", default="inductor",
                   help="torch.compile's backend for the compile rows (aot_eager compiles in "
                   "seconds on a CPU, where inductor takes minutes)")
    p.add_argument("--torch-device", default="auto", help="auto (cuda if there), cuda, cpu")
    p.add_argument("--matmul", action="store_true", help="also one n^3 matmul, TFLOP/s")
    p.add_argument("--matmul-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=None, help="default 1024,2048,4096 (--tiny: 128,256)")
    p.add_argument("--compile", choices=("both", "cold", "none"), default="both",
                   help="cold and warm compile times, each in a fresh process")
    p.add_argument("--compile-jobs", type=int, default=1,
                   help="compile subprocesses at a time (default 1: no contention)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new work after this many seconds (skips are recorded)")
    p.add_argument("--session-order", action="store_true",
                   help="only this: the --only workloads' sessions f32 train, f16 train, f16 "
                   "infer, f32 infer one after another here, each also alone in a fresh process")
    p.add_argument("--session-warmup-s", type=float, default=WARMUP_S,
                   help="--session-order: seconds of steps before a session's steady time (its "
                   "first steps are timed apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(REPO / "out" / "results"))
    p.add_argument("--redraw", type=Path, metavar="RUN.json",
                   help="only write this saved run's markdown and chart again, into --out-dir")
    p.add_argument("--note", default="", help="free text stored in the JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.matmul_sizes is None:
        opts.matmul_sizes = [128, 256] if opts.tiny else [1024, 2048, 4096]
    if opts.reps < 1 or opts.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return opts


def redraw(run: Path, out_dir: Path) -> list[Path]:
    """A saved run's markdown and chart, made again from its JSON into `out_dir`."""
    data = json.loads(run.read_text())
    report = Report(out_dir / run.stem, data["meta"])
    report.rows, report.matmul = data["rows"], data["matmul"]
    report.sessions = data.get("session_order", [])
    return [p for p in (report.write_markdown(), report.write_chart()) if p is not None]


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.redraw:
        for path in redraw(opts.redraw, Path(opts.out_dir)):
            print(f"wrote {path}")
        return 0
    if opts.child:
        spec = json.loads(opts.child)
        child = child_time if spec.get("task") == "time" else child_compile
        print(json.dumps(child(spec)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="vkml-bench-"))
    # A hung step would otherwise hold a lent GPU for vkml's default 300 s; a full-config step
    # takes well under a second. Read when vkml loads, so set before; children inherit it.
    os.environ.setdefault("VKML_WAIT_TIMEOUT", "60")
    # A time limit's SIGTERM unwinds through `finally`, so the markdown and chart still appear.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = None
    try:
        bench = Bench(opts, tmp)
        if bench.torch.cuda:  # the GPU idles at a low clock: spin it up before any timing
            torch = bench.torch.torch
            x = torch.randn(4096, 4096, device=bench.torch.device)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                x @ x
                torch.cuda.synchronize()  # no queue of launches left to drain afterwards
        print(f"vkml on {bench.report.meta['vkml_device']}; PyTorch {bench.report.meta['torch']}"
              f" on {bench.report.meta['torch_device']}", flush=True)
        if opts.session_order:
            for name in opts.only:
                bench.session_order(WORKLOADS[name])
            return 0
        for name in opts.only:
            bench.workload(WORKLOADS[name])
        if opts.matmul:
            print("matmul", flush=True)
            bench.matmul()
        bench.compile_times()
    finally:
        if bench is not None:
            bench.finish()
            bench.device.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
