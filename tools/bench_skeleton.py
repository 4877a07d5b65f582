"""Walking-skeleton measurements: compile time (cold and warm caches) and per-step host overhead.

    PYTHONPATH=. python tools/bench_skeleton.py [--reps 5] [--step-reps 300]

Every figure is measured in a fresh subprocess (this script re-runs itself with --child), so
nothing is shared in memory between measurements:
- compile, cold: VKML_CACHE_DIR, MESA_SHADER_CACHE_DIR and VKML_SPIRV_DIR point at a new empty
  directory (no serialized naga wasm module, no SPIR-V cached or shipped, no VkPipelineCache, no
  driver shader cache);
- compile, warm: a new process on the directory a cold run filled.
"Compile" is graph -> runnable session (`vkml.compile`, for the demo's MLP training graph);
importing vkml and opening the device are reported apart. Drivers that compile lazily (lavapipe
JITs a kernel at its first dispatch) do that work in the first step, which is reported apart from
the steady state and runs on the user's own driver cache.
Steady state follows tools/PROTOCOL.md: warm-up, then timed repetitions, median and min.
Results go to a table on stdout and to out/bench_skeleton.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MLP_SIZES, MLP_BATCH = (256, 128, 64, 6), 64


# ---- children: each prints one JSON object on its last stdout line ----------------------------
def child_compile() -> dict:
    t0 = time.perf_counter()
    import vkml
    from vkml.__main__ import build_classifier
    t1 = time.perf_counter()
    device = vkml.Device()
    t2 = time.perf_counter()
    session = build_classifier(MLP_BATCH, MLP_SIZES, seed=0, device=device)
    t3 = time.perf_counter()
    result = {"import_s": t1 - t0, "device_s": t2 - t1, "compile_s": t3 - t2,
              "kernels": session.kernel_count, "dispatches": len(session.plan.dispatches)}
    session.close()
    device.close()
    return result


def timed(fn: Callable[[], None], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def child_steady(step_reps: int, mlp_reps: int) -> dict:
    import vkml
    from vkml.__main__ import build_classifier

    device = vkml.Device()
    g = vkml.Graph()
    x = g.input("x", (4,))
    tiny = vkml.compile(g, outputs={"y": x * 2.0 + 1.0}, device=device)
    tiny.set_input("x", np.ones(4, np.float32))
    submit_only: list[float] = []

    def submit() -> None:
        # Time only the call returning; the wait happens outside the timed region so that
        # step() never blocks on the previous submission.
        t0 = time.perf_counter()
        tiny.step()
        submit_only.append(time.perf_counter() - t0)
        tiny.wait()

    for _ in range(10):
        submit()
    submit_only.clear()
    for _ in range(step_reps):
        submit()
    tiny_sync = timed(lambda: (tiny.step(), tiny.wait()), 10, step_reps)

    mlp = build_classifier(MLP_BATCH, MLP_SIZES, seed=0, device=device)
    rng = np.random.default_rng(0)
    mlp.set_input("x", rng.standard_normal((MLP_BATCH, MLP_SIZES[0])).astype(np.float32))
    mlp.set_input("labels", rng.integers(0, MLP_SIZES[-1], MLP_BATCH).astype(np.int32))
    first = timed(lambda: (mlp.step(), mlp.wait()), 0, 1)
    mlp_sync = timed(lambda: (mlp.step(), mlp.wait()), 5, mlp_reps)
    result = {"device": device.name, "device_type": device.caps.device_type,
              "driver": device.caps.driver, "api": device.caps.api_version,
              "tiny_submit": submit_only, "tiny_step_wait": tiny_sync,
              "mlp_first_step": first, "mlp_step_wait": mlp_sync,
              "mlp_dispatches": len(mlp.plan.dispatches)}
    for s in (tiny, mlp):
        s.close()
    device.close()
    return result


# ---- parent -----------------------------------------------------------------------------------
def run_child(args: list[str], env_extra: dict[str, str]) -> dict:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, **env_extra, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(name: str, phase: str, samples: list[float], info: dict) -> dict:
    return {"engine": "vkml", "device": info["device"], "driver": info["driver"],
            "mode": "strict", "workload": name, "phase": phase, "unit": "ms",
            "median": 1e3 * statistics.median(samples), "min": 1e3 * min(samples),
            "n": len(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="cold and warm compiles (each)")
    parser.add_argument("--step-reps", type=int, default=300, help="tiny-graph steps timed")
    parser.add_argument("--mlp-reps", type=int, default=30, help="MLP training steps timed")
    parser.add_argument("--out", default=str(REPO / "out" / "bench_skeleton.json"))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind = args.child[0]
        result = (child_compile() if kind == "compile"
                  else child_steady(int(args.child[1]), int(args.child[2])))
        print(json.dumps(result))
        return

    cold, warm = [], []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="vkml-bench-") as cache:
            # No shipped SPIR-V either, so a cold compile really runs naga.
            env = {"VKML_CACHE_DIR": cache, "MESA_SHADER_CACHE_DIR": os.path.join(cache, "mesa"),
                   "VKML_SPIRV_DIR": os.path.join(cache, "no-shipped-spirv")}
            cold.append(run_child(["compile"], env))
            warm.append(run_child(["compile"], env))
        print(f"compile cold {cold[-1]['compile_s']:.3f} s, warm {warm[-1]['compile_s']:.3f} s",
              file=sys.stderr)
    steady = run_child(["steady", str(args.step_reps), str(args.mlp_reps)], {})

    mlp = f"mlp {'-'.join(map(str, MLP_SIZES))} batch {MLP_BATCH} train (Adam)"
    rows = [
        summary(mlp, "import vkml (fresh process)", [r["import_s"] for r in cold + warm], steady),
        summary(mlp, "open device", [r["device_s"] for r in cold + warm], steady),
        summary(mlp, "compile, cold caches", [r["compile_s"] for r in cold], steady),
        summary(mlp, "compile, warm caches", [r["compile_s"] for r in warm], steady),
        summary(mlp, "first step (driver cache of this user)", steady["mlp_first_step"], steady),
        summary(mlp, "step(); wait() steady", steady["mlp_step_wait"], steady),
        summary("tiny (4 floats, 1 dispatch)", "step() returns (submit only)",
                steady["tiny_submit"], steady),
        summary("tiny (4 floats, 1 dispatch)", "step(); wait()", steady["tiny_step_wait"],
                steady),
    ]
    print(f"device: {steady['device']} ({steady['device_type']}), driver {steady['driver']}, "
          f"API {steady['api']}; MLP step = {steady['mlp_dispatches']} dispatches, "
          f"{cold[0]['kernels']} kernels")
    print(f"{'workload':<38} {'phase':<40} {'median ms':>10} {'min ms':>10} {'n':>5}")
    for r in rows:
        print(f"{r['workload']:<38} {r['phase']:<40} {r['median']:>10.3f} {r['min']:>10.3f} "
              f"{r['n']:>5}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": rows},
                                         indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
