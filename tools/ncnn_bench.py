"""vkml against ncnn, the most used Vulkan inference engine, on the same Vulkan driver, in one
process: batch-1 inference of torchvision models from the zoo (tools/zoo_models.py, seeded
weights).

    python tools/ncnn_bench.py --out out/ncnn                   # GPU: published configs, 224^2
    python tools/ncnn_bench.py --tiny --models resnet18 --cpu   # the same code at test size

Per model: pnnx (pip `pnnx`) converts the module, traced to TorchScript, into an ncnn param/bin
pair (f32 weights) in a temporary directory; ncnn (pip `ncnn`) runs it with Vulkan twice: "fp32"
(use_fp16_packed, use_fp16_storage, use_fp16_arithmetic off) and "fp16" (ncnn's defaults, which
store and compute in f16 where the device can), and with `--cpu` once more on the CPU (fp32).
vkml imports the same module (vkml.import_torch) and runs it at precision "f32" and, where the
device has cooperative matrices, "f16". Every row's output is checked against PyTorch in
float64 (relative L2; PROTOCOL.md's forward gate is 1%).

Timing, the same on both engines: one call = input from the host, the network, the output back
on the host (ncnn: a new Extractor, input, extract, as ncnn's own benchmark does; vkml:
set_input, step, read), `--warmup` untimed calls, then the median and min of `--reps` calls
(ms). vkml's rows also give `step(); wait()` alone. Conversion (pnnx) and compile (vkml) times
are recorded apart. A model that pnnx, ncnn or vkml cannot take gets a row saying why, and the
run goes on. Output: <out>/ncnn_bench-<size>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))  # this checkout's vkml first
import bench  # noqa: E402  (its statistics, relative L2 and error text)

MODELS = ("resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny",
          "squeezenet1_1", "shufflenet_v2_x0_5", "regnet_y_400mf", "densenet121")
FORWARD_TOL = bench.FORWARD_TOL


def checked(output: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """The output against float64 PyTorch: relative L2 (an output of another size fails:
    bench.rel_l2 gives inf)."""
    err = bench.rel_l2(output, want)
    return {"rel_l2": err, "pass": bool(err < FORWARD_TOL)}


# ---- ncnn ---------------------------------------------------------------------------------------
def convert(torch: Any, module: Any, x: Any, tmp: Path) -> tuple[Path, Path, float]:
    """pnnx's binary on the module traced to TorchScript: the ncnn param and bin (f32 weights)
    and the seconds it took. pnnx's log is kept out of ours unless it fails."""
    import pnnx

    t0 = time.perf_counter()
    pt = tmp / "model.pt"
    with torch.no_grad():
        torch.jit.trace(module, (x,)).save(str(pt))
    param, binary = tmp / "model.ncnn.param", tmp / "model.ncnn.bin"
    shape = ",".join(str(d) for d in x.shape)
    cmd = [pnnx.EXEC_PATH, str(pt), f"inputshape=[{shape}]f32", "device=cpu", "fp16=0",
           f"ncnnparam={param}", f"ncnnbin={binary}", f"pnnxparam={tmp / 'model.pnnx.param'}",
           f"pnnxbin={tmp / 'model.pnnx.bin'}", f"pnnxpy={tmp / 'model_pnnx.py'}",
           f"pnnxonnx={tmp / 'model.pnnx.onnx'}", f"ncnnpy={tmp / 'model_ncnn.py'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp)
    if proc.returncode != 0 or not param.is_file() or not binary.is_file():
        log = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        raise RuntimeError(f"pnnx failed (exit {proc.returncode}): {' | '.join(log)}")
    return param, binary, time.perf_counter() - t0


NCNN_ROWS = {  # name: (Vulkan, the fp16 options forced off)
    "vulkan fp32": (True, True),
    "vulkan fp16": (True, False),
    "cpu fp32": (False, True),
}


def ncnn_row(variant: str, param: Path, binary: Path, image: np.ndarray, want: np.ndarray,
             warmup: int, reps: int) -> dict[str, Any]:
    import ncnn

    vulkan, fp32 = NCNN_ROWS[variant]
    if vulkan and ncnn.get_gpu_count() == 0:
        raise bench.NotAvailable("ncnn finds no Vulkan device")
    net = ncnn.Net()
    try:
        net.opt.use_vulkan_compute = vulkan
        if fp32:
            net.opt.use_fp16_packed = net.opt.use_fp16_storage = False
            net.opt.use_fp16_arithmetic = False
        options = {k: bool(getattr(net.opt, k)) for k in (
            "use_vulkan_compute", "use_fp16_packed", "use_fp16_storage", "use_fp16_arithmetic")}
        if net.load_param(str(param)) != 0 or net.load_model(str(binary)) != 0:
            raise RuntimeError(f"ncnn could not load {param.name} / {binary.name}")
        (name_in,), (name_out,) = net.input_names(), net.output_names()
        mat = ncnn.Mat(np.ascontiguousarray(image)).clone()

        def call() -> np.ndarray:
            ex = net.create_extractor()
            ex.input(name_in, mat)
            status, out = ex.extract(name_out)
            if status != 0:
                raise RuntimeError(f"ncnn extract returned {status}")
            return np.array(out)

        out = {**checked(call(), want), **bench.timed_calls(call, warmup, reps), "options": options}
        if vulkan:
            out["device"] = ncnn.get_gpu_info(ncnn.get_default_gpu_index()).device_name()
        return out
    finally:
        net.clear()


# ---- vkml ---------------------------------------------------------------------------------------
def vkml_row(vkml: Any, device: Any, module: Any, x: Any, want: np.ndarray, precision: str,
             warmup: int, reps: int) -> dict[str, Any]:
    """vkml.import_torch's graph of `module` at `precision` ("f32" or "f16")."""
    t0 = time.perf_counter()
    imported = vkml.import_torch(module, args=(x,))
    import_s = time.perf_counter() - t0
    (name_in,), (name_out, output) = list(imported.inputs), next(iter(imported.outputs.items()))
    feed = x.numpy()
    t0 = time.perf_counter()
    session = bench.vkml_compile(vkml, imported.graph, device,
                                 "strict" if precision == "f32" else "accelerated", precision,
                                 outputs={name_out: output})
    compile_s = time.perf_counter() - t0
    try:
        def call() -> np.ndarray:
            session.set_input(name_in, feed)
            session.step()
            return session.read(name_out)

        out = {**checked(call(), want), **bench.timed_calls(call, warmup, reps),
               "import_s": import_s, "compile_s": compile_s}
        step = bench.timed_steps(session, 0, reps)
        out["step_ms"] = {"median": step["median_ms"], "min": step["min_ms"]}
        return out
    finally:
        session.close()


# ---- the run ------------------------------------------------------------------------------------
def model_rows(name: str, size: str, opts: argparse.Namespace, vkml: Any, device: Any,
               tmp: Path) -> list[dict[str, Any]]:
    import torch
    import zoo_models

    rows: list[dict[str, Any]] = []

    def add(engine: str, variant: str, run: Callable[[], dict[str, Any]]) -> None:
        base = {"model": name, "size": size, "engine": engine, "variant": variant}
        try:
            row = {**base, "status": "ok", **run()}
        except bench.NotAvailable as e:
            row = {**base, "status": "not available", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            traceback.print_exc()
            row = {**base, "status": "failed", "reason": bench.error_text(e)}
        rows.append(row)
        if row["status"] != "ok":
            timing = f"{row['status']}: {row.get('reason', '')}"
        elif "median_ms" in row:
            timing = f"{row['median_ms']:.3f} ms, rel L2 {row['rel_l2']:.1e}"
        else:
            timing = f"{row['convert_s']:.1f} s"
        print(f"  {name} {engine} {variant}: {timing}", flush=True)

    model = zoo_models.build(name, size, seed=opts.seed)
    module = model.module.eval()
    x = next(iter(model.inputs.values()))[:1].contiguous()
    with torch.no_grad():
        want = module.double()(x.double()).numpy()
        module.float()
    converted: dict[str, Any] = {}

    def conversion() -> dict[str, Any]:
        param, binary, seconds = convert(torch, module, x, tmp)
        converted.update(param=param, binary=binary)
        return {"convert_s": seconds, "input": list(x.shape)}

    add("pnnx", "convert", conversion)
    variants = ["vulkan fp32", "vulkan fp16"] + (["cpu fp32"] if opts.cpu else [])
    for variant in variants:
        def run(variant: str = variant) -> dict[str, Any]:
            if not converted:
                raise bench.NotAvailable("pnnx did not convert the model")
            return ncnn_row(variant, converted["param"], converted["binary"], x[0].numpy(),
                            want, opts.warmup, opts.reps)
        add("ncnn", variant, run)
    for precision in ("f32", "f16"):
        add("vkml", precision, lambda precision=precision: vkml_row(
            vkml, device, module, x, want, precision, opts.warmup, opts.reps))
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# vkml and ncnn, batch-1 inference, {meta['date']}", "",
             f"- Vulkan device: {meta['vkml_device']}; ncnn {meta['ncnn']}, pnnx {meta['pnnx']},"
             f" PyTorch {meta['torch']}; vkml {meta['vkml_commit']}; zoo size {meta['size']}",
             f"- {meta['warmup']} warm-up + {meta['reps']} timed calls per row: input from the "
             "host, the network, output to the host. Median (min) ms; vkml step: "
             "`step(); wait()` alone. rel L2: against PyTorch float64.", "",
             "| model | engine | variant | ms | vkml step ms | rel L2 | convert / compile s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["engine"] == "pnnx":
            continue
        head = f"| {r['model']} | {r['engine']} | {r['variant']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']}: {r.get('reason', '')[:160]} | | | |")
            continue
        step = "-" if r.get("step_ms") is None else f"{r['step_ms']['median']:.3g}"
        prep = r.get("compile_s")
        if prep is None:
            conv = next((c for c in rows if c["model"] == r["model"] and c["engine"] == "pnnx"
                         and c["status"] == "ok"), None)
            prep = conv["convert_s"] if conv else None
        lines.append(f"{head} {r['median_ms']:.3g} ({r['min_ms']:.3g}) | "
                     f"{step} | "
                     f"{r['rel_l2']:.1e}{'' if r['pass'] else ' FAIL'} | "
                     f"{'-' if prep is None else f'{prep:.1f}'} |")
    failed = [r for r in rows if r["engine"] == "pnnx" and r["status"] != "ok"]
    if failed:
        lines += ["", "Not converted by pnnx:", ""]
        lines += [f"- {r['model']}: {r.get('reason', '')}" for r in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help="zoo models, comma-separated (default: the torchvision ones above)")
    p.add_argument("--tiny", action="store_true", help="the zoo's tiny sizes (lavapipe)")
    p.add_argument("--reps", type=int, default=50, help="timed calls per row (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    p.add_argument("--cpu", action="store_true", help="also ncnn on the CPU (fp32)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new model after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(TOOLS.parent / "out"))
    opts = p.parse_args(argv)
    import ncnn
    import pnnx
    import torch

    import vkml

    torch.set_num_threads(min(torch.get_num_threads(), 8))
    size = "tiny" if opts.tiny else "full"
    device = vkml.Device()
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "vkml_device": repr(device), "vkml_commit": bench.git_commit(),
            "ncnn": ncnn.__version__, "pnnx": getattr(pnnx, "__version__", "?"),
            "torch": torch.__version__, "size": size, "reps": opts.reps,
            "warmup": opts.warmup, "command": " ".join(sys.argv)}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        for name in [m.strip() for m in opts.models.split(",") if m.strip()]:
            if opts.budget_s and time.perf_counter() - start > opts.budget_s:
                rows.append({"model": name, "size": size, "engine": "pnnx",
                             "variant": "convert", "status": "skipped",
                             "reason": f"--budget-s {opts.budget_s:g} s reached"})
                continue
            print(name, flush=True)
            with tempfile.TemporaryDirectory(prefix="ncnn-bench-") as tmp:
                rows += model_rows(name, size, opts, vkml, device, Path(tmp))
            (out / f"ncnn_bench-{size}.json").write_text(
                json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    finally:
        meta["elapsed_s"] = time.perf_counter() - start
        (out / f"ncnn_bench-{size}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
        text = markdown(rows, meta)
        (out / f"ncnn_bench-{size}.md").write_text(text)
        print(text)
        device.close()
        ncnn.destroy_gpu_instance()
    return 0


if __name__ == "__main__":
    sys.exit(main())
