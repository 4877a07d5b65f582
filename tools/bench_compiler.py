"""The compiler measured, in two parts.

`fusion`: what the compiler's middle buys, on an MLP, a 4-layer transformer and a small conv net:
dispatches and barriers without and with fusion, logical bytes (one buffer per tensor) against
the bytes the memory plan allocates, and compile time (graph to plan, and to a runnable session
with warm caches). Inference and training (Adam) each.

`scaling`: compile time against graph size (--sizes, in nodes the user builds), stage by stage,
so growth faster than linear shows: graph build, autodiff, rewrite, split, schedule, memory,
codegen (vkml.compiler.stages.lower's timings), naga (each distinct kernel's WGSL translated to
SPIR-V by a fresh naga.Compiler with empty caches; the wasm module's one-time load not
included) and binding (vkml.Session on the plan: arenas, pipelines, initial values, recording;
SPIR-V already in memory). Families: "pointwise", a chain of elementwise ops that fuses into one
kernel (issue 11's case), inference; "transformer", GPT-style blocks of a small width, training
with Adam (many kernels, most of them repeated from layer to layer).

`models`: `vkml.compile` of the reference models at their FULL configs (tools/bench.py's
workloads: training with Adam, and inference), cold and warm, each in a fresh process as
tools/bench.py times them: cold with empty caches (VKML_CACHE_DIR, Mesa's and NVIDIA's shader
caches; the shipped SPIR-V is used), warm on what the cold run left. The compile splits into the
Python stages (lowering: autodiff ... codegen, or the plan cache's lookup when it holds the
plan), pipeline creation (the driver's compiles, several threads at once, each thread first
waiting for naga's WGSL to SPIR-V: naga's time, summed over threads, is shown apart but lies
within), the initial values' upload, recording, and the rest of binding.
Graph building (inside the model's `build`) is timed too, outside the compile.

    python tools/bench_compiler.py [--part fusion|scaling|models|plans|all]
                                   [--sizes 1000,2000,4000,8000]
                                   [--families pointwise,transformer] [--models smollm2,...]
                                   [--phases train,infer] [--out PATH] [--markdown PATH]

`plans`: the reference models at their full configs as planned for a discrete GPU (this
device's capabilities as a GPU's: tiled kernels, split products, no loop limit), without any
device work: dispatches, barriers and planned memory, the counts a GPU step pays for.

`all` is fusion and scaling. Caches (naga's SPIR-V, the pipeline cache) go to a temporary
VKML_CACHE_DIR unless one is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import vkml  # noqa: E402
from vkml import nn  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.vk import naga  # noqa: E402


def mlp(g: vkml.Graph):
    x = g.input("x", (64, 256))
    labels = g.input("labels", (64,), "i32")
    h = x
    for i, (a, b) in enumerate([(256, 128), (128, 64)]):
        h = nn.Linear(g, f"fc{i + 1}", a, b)(h).relu()
    logits = nn.Linear(g, "fc3", 64, 6)(h)
    return logits, g.cross_entropy(logits, labels)


def transformer(g: vkml.Graph, layers=4, batch=2, seq=64, dim=128, heads=4, vocab=256):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks of causal
    self-attention and a GELU MLP, tied output projection."""
    ids = g.input("ids", (batch, seq), "i32")
    targets = g.input("targets", (batch * seq,), "i32")
    wte = g.param("wte", (vocab, dim), "normal", 0.02)
    h = g.add(g.embedding(ids, wte), g.param("wpe", (seq, dim), "normal", 0.02))
    for i in range(layers):
        a = g.layer_norm(h, (dim,), g.param(f"h{i}.ln1.weight", (dim,), 1.0),
                         g.param(f"h{i}.ln1.bias", (dim,)))
        qkv = nn.Linear(g, f"h{i}.attn.qkv", dim, 3 * dim)(a.reshape(batch * seq, dim))
        q, k, v = (t.reshape(batch, seq, heads, dim // heads).transpose(0, 2, 1, 3)
                   for t in g.split(qkv, dim, axis=1))
        att = g.scaled_dot_product_attention(q, k, v, causal=True)
        att = att.transpose(0, 2, 1, 3).reshape(batch * seq, dim)
        h = h + nn.Linear(g, f"h{i}.attn.proj", dim, dim)(att).reshape(batch, seq, dim)
        m = g.layer_norm(h, (dim,), g.param(f"h{i}.ln2.weight", (dim,), 1.0),
                         g.param(f"h{i}.ln2.bias", (dim,)))
        m = nn.Linear(g, f"h{i}.mlp.fc", dim, 4 * dim)(m.reshape(batch * seq, dim)).gelu()
        h = h + nn.Linear(g, f"h{i}.mlp.proj", 4 * dim, dim)(m).reshape(batch, seq, dim)
    h = g.layer_norm(h, (dim,), g.param("ln_f.weight", (dim,), 1.0), g.param("ln_f.bias", (dim,)))
    logits = g.matmul(h.reshape(batch * seq, dim), wte, transpose_b=True)
    return logits, g.cross_entropy(logits, targets)


def convnet(g: vkml.Graph, batch=8, size=32):
    x = g.input("x", (batch, 3, size, size))
    labels = g.input("labels", (batch,), "i32")
    h, channels = x, 3
    for i, out in enumerate((16, 32, 64)):
        w = g.param(f"conv{i}.weight", (out, channels, 3, 3), "normal", (2 / (9 * channels)) ** .5)
        h = g.conv2d(h, w, g.param(f"conv{i}.bias", (out,)), padding=1).relu()
        h = g.max_pool2d(h, 2)
        channels = out
    h = g.global_avg_pool2d(h).reshape(batch, channels)
    logits = nn.Linear(g, "fc", channels, 10)(h)
    return logits, g.cross_entropy(logits, labels)


MODELS = {"mlp": mlp, "transformer-4L": transformer, "convnet": convnet}


def measure(name, build, device, mode, rewrite, reps):
    g = vkml.Graph(seed=0)
    logits, loss = build(g)
    kwargs = ({"outputs": {"logits": logits}} if mode == "inference"
              else {"loss": loss, "optimizer": vkml.Adam()})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        stages = lower(g, device.caps, rewrite=rewrite, **kwargs)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    session = vkml.compile(g, device=device, rewrite=rewrite, **kwargs)
    compile_s = time.perf_counter() - t0
    plan = stages.plan
    report = plan.memory_report()
    session.close()
    return {"model": name, "mode": mode, "rewrite": rewrite, "dispatches": len(plan.dispatches),
            "barriers": plan.barrier_count, "kernels": len({d.kernel.wgsl for d in
                                                            plan.dispatches}),
            "logical_bytes": report["logical"], "physical_bytes": report["physical"],
            "physical_over_logical": report["physical"] / report["logical"],
            "lower_s_median": statistics.median(times), "lower_s_min": min(times),
            "compile_s_warm": compile_s}


def fusion(device: vkml.Device, reps: int) -> list[dict]:
    rows = []
    for name, build in MODELS.items():
        for mode in ("inference", "training"):
            for rewrite in ("none", "greedy"):
                measure(name, build, device, mode, rewrite, 1)  # warms the kernel caches
                rows.append(measure(name, build, device, mode, rewrite, reps))
    print(f"{'model':15} {'mode':9} {'rewrite':7} {'disp':>5} {'barr':>5} {'kern':>5} "
          f"{'logical':>11} {'physical':>11} {'ratio':>6} {'lower s':>8} {'compile s':>9}")
    for r in rows:
        print(f"{r['model']:15} {r['mode']:9} {r['rewrite']:7} {r['dispatches']:5} "
              f"{r['barriers']:5} {r['kernels']:5} {r['logical_bytes']:11} "
              f"{r['physical_bytes']:11} {r['physical_over_logical']:6.2f} "
              f"{r['lower_s_median']:8.3f} {r['compile_s_warm']:9.3f}")
    return rows


# ---- scaling: time against graph size ------------------------------------------------------------
def pointwise_chain(nodes: int) -> tuple[vkml.Graph, dict]:
    """Elementwise ops in a chain (each step h = tanh(h * 1.01 + x), the constant a literal) until
    the graph has `nodes` nodes; rewritten, it is one kernel."""
    g = vkml.Graph(seed=0)
    x = g.input("x", (64, 256))
    h = x
    while len(g.nodes) < nodes:
        h = (h * 1.01 + x).tanh()
    return g, {"outputs": {"y": h}}


def transformer_blocks(nodes: int) -> tuple[vkml.Graph, dict]:
    """The transformer above at width 64, as many layers as make about `nodes` nodes; a
    training step (Adam)."""
    per_layer = _nodes_per_layer()
    layers = max(1, round((nodes - per_layer[0]) / per_layer[1]))
    g = vkml.Graph(seed=0)
    _, loss = transformer(g, layers=layers, batch=2, seq=32, dim=64, heads=4, vocab=128)
    return g, {"loss": loss, "optimizer": vkml.Adam()}


def _nodes_per_layer() -> tuple[int, int]:
    """(nodes outside the layers, nodes per layer) of transformer() at the scaling width."""
    counts = []
    for layers in (1, 2):
        g = vkml.Graph(seed=0)
        transformer(g, layers=layers, batch=2, seq=32, dim=64, heads=4, vocab=128)
        counts.append(len(g.nodes))
    return counts[0] - (counts[1] - counts[0]), counts[1] - counts[0]


FAMILIES = {"pointwise": pointwise_chain, "transformer": transformer_blocks}
STAGE_COLUMNS = ("build", "autodiff", "rewrite", "split", "schedule", "memory", "codegen", "naga",
                 "bind")


def scale_point(family: str, nodes: int, device: vkml.Device, scratch: Path) -> dict:
    """One compile of `family` at about `nodes` nodes, each stage timed."""
    gc.collect()  # the previous point's garbage is not this one's time
    t0 = time.perf_counter()
    g, kwargs = FAMILIES[family](nodes)
    row: dict = {"family": family, "nodes": len(g.nodes), "build": time.perf_counter() - t0}
    t0 = time.perf_counter()
    stages = lower(g, device.caps, **kwargs)
    row["lower"] = time.perf_counter() - t0
    row.update(stages.timings)
    kernels = list({d.kernel.wgsl: d.kernel for d in stages.plan.dispatches}.values())
    row.update(dispatches=len(stages.plan.dispatches), kernels=len(kernels),
               wgsl_bytes=sum(len(k.wgsl) for k in kernels))
    # naga cold: a compiler of its own with empty caches, its wasm module loaded beforehand
    cold = naga.Compiler(cache_dir=tempfile.mkdtemp(dir=scratch),
                         shipped_dir=scratch / "no-shipped-spirv")
    cold.compile("@compute @workgroup_size(1) fn main() {}", "warm-up")
    t0 = time.perf_counter()
    for k in kernels:
        cold.compile(k.wgsl, k.name)
    row["naga"] = time.perf_counter() - t0
    for k in kernels:  # the session's own compiler: SPIR-V from here on comes from memory
        naga.compile_wgsl(k.wgsl, k.name)
    t0 = time.perf_counter()
    session = vkml.Session(stages.plan, device)
    row["bind"] = time.perf_counter() - t0
    session.close()
    row["total"] = sum(row.get(c, 0.0) for c in STAGE_COLUMNS)
    return row


def scaling(device: vkml.Device, families: list[str], sizes: list[int], scratch: Path
            ) -> list[dict]:
    rows = []
    scale_point(families[0], min(sizes), device, scratch)  # imports, first pipelines: untimed
    for family in families:
        for n in sizes:
            rows.append(scale_point(family, n, device, scratch))
            print(scaling_line(rows[-1]), flush=True)
    return rows


def scaling_header() -> str:
    return (f"{'family':12} {'nodes':>6} {'disp':>6} {'kern':>5} "
            + " ".join(f"{c:>8}" for c in (*STAGE_COLUMNS, "total")))


def scaling_line(r: dict) -> str:
    return (f"{r['family']:12} {r['nodes']:6} {r['dispatches']:6} {r['kernels']:5} "
            + " ".join(f"{r.get(c, 0.0):8.3f}" for c in (*STAGE_COLUMNS, "total")))


def scaling_markdown(rows: list[dict], meta: dict) -> str:
    cols = (*STAGE_COLUMNS, "total")
    lines = [f"# Compile time against graph size ({meta['date']})", "",
             f"Device {meta['device']}, {meta['cpu']}, Python {meta['python']}, vkml "
             f"{meta['commit']}. Seconds per stage; `nodes` counts the graph the user builds "
             "(autodiff adds the backward pass). Command: `python tools/bench_compiler.py "
             "--part scaling`.", "",
             "| family | nodes | dispatches | kernels | " + " | ".join(cols) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in cols) + " |"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['nodes']} | {r['dispatches']} | {r['kernels']} | "
                     + " | ".join(f"{r.get(c, 0.0):.3f}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


# ---- models: full configs, cold and warm ---------------------------------------------------------
MODEL_COLUMNS = ("lower", "naga", "pipelines", "upload", "record", "bind_other")


def child_compile(spec: dict) -> dict:
    """In a fresh process: build one full-config workload and compile it, each part timed."""
    from bench import WORKLOADS, session_args

    from vkml import session as session_module
    from vkml.compiler import stages as stages_module
    from vkml.runtime import bound, pipeline_pool

    times = dict.fromkeys(MODEL_COLUMNS, 0.0)
    stage_times: dict = {}

    def timed(column, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[column] += time.perf_counter() - t0
        return wrapper

    lower_fn = stages_module._lower  # what compile_plan runs when the plan cache misses

    def lowered(*args, **kwargs):
        stages = lower_fn(*args, **kwargs)
        stage_times.update(stages.timings)
        return stages

    stages_module._lower = lowered  # the stages' times, when the plan cache misses
    session_module.compile_plan = timed("lower", session_module.compile_plan)
    naga.compile_wgsl = timed("naga", naga.compile_wgsl)
    pipeline_pool.PipelinePool.acquire = timed("pipelines", pipeline_pool.PipelinePool.acquire)
    bound.BoundPlan.write_initial_values = timed("upload", bound.BoundPlan.write_initial_values)
    bound.BoundPlan.record = timed("record", bound.BoundPlan.record)
    t0 = time.perf_counter()
    device = vkml.Device()
    t1 = time.perf_counter()
    built = WORKLOADS[spec["workload"]].build(False, spec["phase"])
    t2 = time.perf_counter()
    session = vkml.compile(built.graph, device=device,
                           **session_args(vkml, built, spec["phase"]))
    t3 = time.perf_counter()
    kernels, dispatches = session.kernel_count, len(session.plan.dispatches)
    session.close()
    device.close()  # writes the pipeline cache a warm run reads
    times["bind_other"] = (t3 - t2) - sum(v for c, v in times.items() if c != "naga")
    return {"device_s": t1 - t0, "build_s": t2 - t1, "compile_s": t3 - t2, **times,
            "stages": stage_times, "kernels": kernels, "dispatches": dispatches,
            "naga_stats": naga.cache_stats()}


def models(names: list[str], phases: list[str], scratch: Path) -> list[dict]:
    from bench import cache_env

    rows = []
    print(f"{'model':16} {'phase':5} {'run':4} {'build':>6} {'compile':>7} "
          + " ".join(f"{c:>10}" for c in MODEL_COLUMNS) + "  naga translations")
    for name in names:
        for phase in phases:
            cache = Path(tempfile.mkdtemp(prefix=f"{name}-{phase}-", dir=scratch))
            for run in ("cold", "warm"):
                paths = [str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")]
                env = {**os.environ, **cache_env(cache),
                       "PYTHONPATH": os.pathsep.join(filter(None, paths))}
                proc = subprocess.run(
                    [sys.executable, __file__, "--child",
                     json.dumps({"workload": name, "phase": phase})],
                    env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
                if proc.returncode != 0:
                    print(f"{name} {phase} {run}: failed\n{proc.stderr[-2000:]}")
                    break
                r = {"model": name, "phase": phase, "run": run,
                     **json.loads(proc.stdout.strip().splitlines()[-1])}
                rows.append(r)
                print(f"{name:16} {phase:5} {run:4} {r['build_s']:6.2f} {r['compile_s']:7.2f} "
                      + " ".join(f"{r[c]:10.2f}" for c in MODEL_COLUMNS)
                      + f"  {r['naga_stats']['compiles']}", flush=True)
    return rows


def plans(device: vkml.Device, names: list[str], phases: list[str]) -> list[dict]:
    from bench import WORKLOADS, session_args

    caps = dataclasses.replace(device.caps, device_type="discrete", max_loop_iterations=None)
    rows = []
    for name in names:
        for phase in phases:
            built = WORKLOADS[name].build(False, phase)
            plan = lower(built.graph, caps, **session_args(vkml, built, phase)).plan
            rows.append({"model": name, "phase": phase, "dispatches": len(plan.dispatches),
                         "barriers": plan.barrier_count,
                         "planned_mib": plan.memory_report()["physical"] / 2**20})
            print(f"{name:16} {phase:5} {rows[-1]['dispatches']:6} dispatches "
                  f"{rows[-1]['barriers']:6} barriers {rows[-1]['planned_mib']:8.1f} MiB",
                  flush=True)
    return rows


def plans_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Reference models as planned for a discrete GPU ({meta['date']})", "",
             f"vkml {meta['commit']}, full configs, `python tools/bench_compiler.py --part "
             "plans`: dispatches and barriers per step, planned device memory.", "",
             "| model | phase | dispatches | barriers | planned MiB |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['phase']} | {r['dispatches']} | {r['barriers']} | "
              f"{r['planned_mib']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def models_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Full-config compile times, cold and warm ({meta['date']})", "",
             f"Device {meta['device']}, {meta['cpu']}, Python {meta['python']}, vkml "
             f"{meta['commit']}. Seconds. `compile` is `vkml.compile` (graph building not "
             "included: `build`); lower = the Python stages (warm: the plan cache's lookup), "
             "naga = WGSL to SPIR-V (with "
             "its cache lookups; summed over the threads that create pipelines, so within "
             "`pipelines`), pipelines = the session's pipelines made, the driver's compiles "
             "several at a time (lavapipe here: not representative of a GPU driver), "
             "upload = the initial values written, "
             "record = command buffers. Command: `python tools/bench_compiler.py --part models`.",
             "", "| model | phase | run | build | compile | " + " | ".join(MODEL_COLUMNS)
             + " | naga translations |",
             "| --- | --- | --- | ---: | ---: | " + " | ".join("---:" for _ in MODEL_COLUMNS)
             + " | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['phase']} | {r['run']} | {r['build_s']:.2f} | "
                     f"{r['compile_s']:.2f} | " + " | ".join(f"{r[c]:.2f}" for c in MODEL_COLUMNS)
                     + f" | {r['naga_stats']['compiles']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("fusion", "scaling", "models", "plans", "all"),
                        default="all")
    parser.add_argument("--models", default="smollm2,smolvla_expert,unet,resnet,whisper_encoder",
                        help="full-config workloads of the models part (tools/bench.py's)")
    parser.add_argument("--phases", default="train,infer", help="phases of the models part")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench_compiler.json")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the scaling or models table as markdown here")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="1000,2000,4000,8000",
                        help="graph sizes (nodes) of the scaling part")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"scaling families: {', '.join(FAMILIES)}")
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child_compile(json.loads(opts.child))))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_compiler-") as tmp:
        scratch = Path(tmp)
        os.environ.setdefault("VKML_CACHE_DIR", str(scratch / "cache"))
        device = vkml.Device()
        print(f"device: {device.name}")
        from bench import git_commit
        meta = {"device": device.name, "date": time.strftime("%Y-%m-%d %H:%M"),
                "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "python": platform.python_version(), "commit": git_commit()}
        result: dict = {"device": device.name, "meta": meta}
        if opts.part in ("fusion", "all"):
            result["rows"] = fusion(device, opts.reps)
        if opts.part in ("scaling", "all"):
            print(scaling_header())
            result["scaling"] = scaling(device, opts.families.split(","),
                                        [int(n) for n in opts.sizes.split(",")], scratch)
        if opts.part == "plans":
            result["plans"] = plans(device, opts.models.split(","), opts.phases.split(","))
        device.close()  # the models part's children open their own
        markdown = scaling_markdown(result["scaling"], meta) if "scaling" in result else ""
        if opts.part == "models":
            result["models"] = models(opts.models.split(","), opts.phases.split(","), scratch)
            markdown += models_markdown(result["models"], meta)
        if "plans" in result:
            markdown += plans_markdown(result["plans"], meta)
        if opts.markdown is not None and markdown:
            opts.markdown.parent.mkdir(parents=True, exist_ok=True)
            opts.markdown.write_text(markdown)
            print(f"wrote {opts.markdown}")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
