"""The model zoo: torchvision and Hugging Face models, exported by PyTorch to ONNX and through
torch.export, imported into vkml both ways, and checked against PyTorch and onnxruntime.

    python tools/zoo.py                          # every model, small configurations
    python tools/zoo.py --size tiny --only resnet18,bert --ways onnx
    python tools/zoo.py --size full --bench      # on a GPU: step times beside PyTorch's

Per model and way (the models are in tools/zoo_models.py, random weights from a seed):
- import: the graph, or the refusal's op list (ModelImportError) and nothing else;
- forward: vkml's output against PyTorch's (and onnxruntime's on the ONNX way), relative L2;
- gradients: every parameter's gradient of an MSE loss over the output against torch autograd
  (worst per-parameter relative L2, the total-norm error and the worst cosine: PROTOCOL.md);
- training: three AdamW steps against torch.optim (relative L2 over all parameters, and the
  worst one);
- save back: the tuned model through `save_onnx` run by onnxruntime, or through `state_dict`
  loaded strictly into the PyTorch module, against vkml's own output after training;
- compile time of the training session, and with --bench the median step time of vkml's
  training step beside PyTorch eager and torch.compile (wall time around a synchronised step).

Models run in eval mode (dropout off, batch norm from running statistics) on both sides: the
fine-tuning a user does. Results go to a JSON file and a Markdown table under --out
(default out/zoo/); the tables the README and KERNELS.md cite are copied to tools/results/.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vkml first
import bench  # noqa: E402
import zoo_models  # noqa: E402

import vkml  # noqa: E402

FORWARD_GATE = 1e-4  # strict f32, relative L2 (the gate)
TRAIN_GATE = 1e-4  # parameters after three AdamW steps, relative L2
GRAD_NORM_GATE = 0.05  # PROTOCOL.md: total and per-parameter gradient norm error
GRAD_COSINE_GATE = 0.99  # PROTOCOL.md: per-parameter cosine similarity
NOISE_FLOOR = 1e-5  # a parameter's gradient under this share of the total norm is noise
STEPS = 3
# AdamW's first steps move each element by about lr * sign(gradient), so an element whose
# gradient is rounding noise on both sides (a ReLU's edge) moves by 2 lr more in one engine
# than in the other: the gate on the parameters after three steps scales with lr. 1e-4 is a
# fine-tuning rate; at 1e-3 ResNet-18's parameters differed by 2.6e-4 with gradients that
# agreed to 1.3e-6.
LR = 1e-4
WAYS = ("onnx", "torch")


@dataclass
class Row:
    """One model imported one way: what happened at each check (None: not reached)."""

    model: str
    way: str
    size: str
    params: int = 0
    exporter: str | None = None  # torchscript / dynamo (torch.onnx), export (torch.export)
    status: str = "not run"  # "pass", "fail", "refused", "error"; "imported" (--import-only)
    refused: dict[str, int] | None = None
    error: str | None = None
    import_s: float | None = None
    compile_s: float | None = None
    forward_torch: float | None = None
    forward_ort: float | None = None
    grad_worst: float | None = None
    grad_worst_name: str | None = None
    grad_norm_error: float | None = None
    grad_cosine_min: float | None = None
    grads_compared: int = 0
    grads_unmatched: int = 0
    train: float | None = None
    train_worst: float | None = None
    saved: float | None = None
    bench: dict[str, float] = field(default_factory=dict)


def rel_l2(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} against {expected.shape}")
    if not np.all(np.isfinite(actual)):
        return math.inf
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / (na * nb)) if na and nb else 0.0


def export_onnx(torch, model: zoo_models.ZooModel, path: Path, training: bool = False) -> str:
    """torch.onnx's TorchScript exporter at opset 17, nothing folded into other initializers
    (batch norm stays a node, so every parameter keeps its state_dict name); where it cannot
    export the model (newer transformers' masks, VGG's adaptive pool to a larger map), the
    torch.export-based exporter, unoptimized for the same reason (its optimizer folds batch norm
    into the convolution before it, whose weight is then no longer the module's). Returns which
    exporter wrote the file."""
    args, names = tuple(model.inputs.values()), list(model.inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model.module, args, str(path), dynamo=False, input_names=names,
                              output_names=["output"], opset_version=17,
                              do_constant_folding=False,
                              training=torch.onnx.TrainingMode.TRAINING if training
                              else torch.onnx.TrainingMode.EVAL)
            return "torchscript"
        except Exception:  # noqa: BLE001 (any exporter failure: try the other exporter)
            torch.onnx.export(model.module, args, str(path), dynamo=True, input_names=names,
                              output_names=["output"], opset_version=18, external_data=False,
                              optimize=False)
            return "dynamo"


def import_model(torch, model: zoo_models.ZooModel, way: str, workdir: Path):
    if way == "onnx":  # else "torch" (main checks --ways)
        path = workdir / "model.onnx"
        row_exporter = export_onnx(torch, model, path)
        return vkml.import_onnx(str(path)), path, row_exporter
    return vkml.import_torch(model.module, args=tuple(model.inputs.values())), None, "export"


def feeds_of(imp, model: zoo_models.ZooModel) -> dict[str, np.ndarray]:
    """The example inputs under the imported graph's input names (in the module's order)."""
    if len(imp.inputs) != len(model.inputs):
        raise AssertionError(f"imported inputs {list(imp.inputs)} for {list(model.inputs)}")
    return {name: value.numpy() for name, value in zip(imp.inputs, model.inputs.values())}


def torch_reference(torch, model: zoo_models.ZooModel, target):
    """PyTorch's output, every parameter's gradient of the MSE loss, and the module after
    STEPS AdamW steps."""
    module = copy.deepcopy(model.module)
    args = tuple(model.inputs.values())
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    out, grads = None, {}
    for step in range(STEPS):
        opt.zero_grad()
        y = module(*args)
        loss = torch.nn.functional.mse_loss(y, target)
        loss.backward()
        if step == 0:
            out = y.detach().numpy()
            grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()
                     if p.grad is not None}
        opt.step()
    return out, grads, module


def check_gradients(row: Row, grads: dict[str, np.ndarray], session) -> bool:
    worst, worst_name, cos_min = 0.0, None, 1.0
    ours_sq = ref_sq = 0.0
    total = math.sqrt(sum(float(np.sum(r.astype(np.float64) ** 2)) for r in grads.values()))
    names = set(session.params())
    for name, ref in grads.items():
        if name not in names:
            row.grads_unmatched += 1
            continue
        mine = np.asarray(session.grad(name), np.float64)
        # A gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
        # per-query constant) is rounding noise on both sides, so its error is measured
        # against the whole gradient's norm rather than against its own noise.
        scale = max(float(np.linalg.norm(ref)), NOISE_FLOOR * total)
        err = float(np.linalg.norm(mine - ref)) / scale if scale else 0.0
        if err > worst:
            worst, worst_name = err, name
        if np.linalg.norm(ref) >= NOISE_FLOOR * total:
            cos_min = min(cos_min, cosine(mine, ref))
        ours_sq += float(np.sum(np.asarray(mine, np.float64) ** 2))
        ref_sq += float(np.sum(ref.astype(np.float64) ** 2))
        row.grads_compared += 1
    row.grad_worst, row.grad_worst_name, row.grad_cosine_min = worst, worst_name, cos_min
    row.grad_norm_error = abs(math.sqrt(ours_sq) - math.sqrt(ref_sq)) / max(math.sqrt(ref_sq),
                                                                            1e-30)
    # parameters an exporter renamed (torch.onnx's dynamo exporter names some initializers
    # itself) cannot be paired with PyTorch's: they are counted in the table, and the saved-back
    # forward after training still covers them
    return (worst < GRAD_NORM_GATE and cos_min > GRAD_COSINE_GATE
            and row.grad_norm_error < GRAD_NORM_GATE and row.grads_compared > 0)


def run_one(torch, name: str, way: str, size: str, bench: bool, device,
            import_only: bool = False) -> Row:
    model = zoo_models.build(name, size)
    row = Row(name, way, size, params=sum(p.numel() for p in model.module.parameters()))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            t0 = time.perf_counter()
            imp, onnx_path, row.exporter = import_model(torch, model, way, Path(tmp))
            row.import_s = time.perf_counter() - t0
        except vkml.ModelImportError as e:
            row.status = "refused"
            row.refused = getattr(e, "unsupported", None) or {}
            row.error = str(e).splitlines()[0] + " | " + " | ".join(str(e).splitlines()[1:6])
            return row
        except Exception as e:  # an importer bug: reported as such, the run goes on
            row.status = "error"
            row.error = f"import: {type(e).__name__}: {e}".splitlines()[0][:400]
            traceback.print_exc()
            return row
        if import_only:
            row.status = "imported"
            return row
        try:
            _check(torch, row, model, imp, onnx_path, bench, device, Path(tmp))
        except Exception as e:  # a zoo run reports every model, whatever fails in one
            row.status = "error"
            row.error = f"{type(e).__name__}: {e}".splitlines()[0][:400]
            traceback.print_exc()
    return row


def _check(torch, row: Row, model, imp, onnx_path, bench: bool, device, tmp: Path) -> None:
    feeds = feeds_of(imp, model)
    (out_name, out), = list(imp.outputs.items())[:1]
    torch.manual_seed(1)
    with torch.no_grad():
        ref_out = model.module(*model.inputs.values())
    if not torch.any(ref_out != ref_out.flatten()[0]):
        raise AssertionError("PyTorch's output is constant: every check would pass vacuously")
    target = torch.randn_like(ref_out)
    ref_out, ref_grads, trained = torch_reference(torch, model, target)

    g = imp.graph
    loss = g.mse(out, g.input("zoo_target", tuple(target.shape)))
    outputs = {out_name: out}

    grads = vkml.compile(g, loss=loss, outputs=outputs, device=device, keep_grads=True)
    for k, v in feeds.items():
        grads.set_input(k, v)
    grads.set_input("zoo_target", target.numpy())
    grads.step()
    row.forward_torch = rel_l2(grads.read(out_name), ref_out)
    if onnx_path is not None:
        import onnxruntime as ort
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        (ort_out,) = sess.run(None, _ort_feeds(sess, feeds))[:1]
        row.forward_ort = rel_l2(grads.read(out_name), ort_out)
    grads_ok = check_gradients(row, ref_grads, grads)
    grads.close()

    t0 = time.perf_counter()
    # what PyTorch trains: an ONNX file does not say which tensors require gradients, so a
    # user names them, as here (Whisper's positional table is fixed)
    frozen = {n for n, p in model.module.named_parameters() if not p.requires_grad}
    s = vkml.compile(g, loss=loss, optimizer=vkml.AdamW(lr=LR), outputs=outputs, device=device,
                     trainable=lambda n: n not in frozen and n in g.params
                     and g.params[n].attrs.get("trainable", True))
    row.compile_s = time.perf_counter() - t0
    for _ in range(STEPS):
        for k, v in feeds.items():
            s.set_input(k, v)
        s.set_input("zoo_target", target.numpy())
        s.step()
    params = s.params()
    worst, mine_all, ref_all = 0.0, [], []
    for pname, p in trained.named_parameters():
        if pname in params:
            ref = p.detach().numpy()
            worst = max(worst, rel_l2(params[pname], ref))
            mine_all.append(np.ravel(params[pname]))
            ref_all.append(np.ravel(ref))
    row.train_worst = worst
    row.train = rel_l2(np.concatenate(mine_all), np.concatenate(ref_all)) if ref_all else None

    s.forward()
    after = s.read(out_name)
    if onnx_path is not None:
        import onnxruntime as ort
        tuned = tmp / "tuned.onnx"
        imp.save_onnx(s, str(tuned))
        sess = ort.InferenceSession(str(tuned), providers=["CPUExecutionProvider"])
        row.saved = rel_l2(sess.run(None, _ort_feeds(sess, feeds))[0], after)
    else:
        back = copy.deepcopy(model.module)
        back.load_state_dict(imp.state_dict(s), strict=True)
        with torch.no_grad():
            row.saved = rel_l2(back(*model.inputs.values()).numpy(), after)

    if bench:
        row.bench = benchmark(torch, model, s, feeds, target)
    s.close()
    checks = [row.forward_torch < FORWARD_GATE, grads_ok,
              row.train is not None and row.train < TRAIN_GATE, row.saved < FORWARD_GATE]
    if row.forward_ort is not None:
        checks.append(row.forward_ort < FORWARD_GATE)
    row.status = "pass" if all(checks) else "fail"


def _ort_feeds(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime takes the exported dtypes: int64 where PyTorch's ids were."""
    out = {}
    for inp in sess.get_inputs():
        value = feeds[inp.name]
        out[inp.name] = value.astype(np.int64) if "int64" in inp.type else value
    return out


def benchmark(torch, model, session, feeds, target, reps: int = 20) -> dict[str, float]:
    """Median wall time (ms) of one synchronised training step: vkml's, PyTorch eager's and
    torch.compile's (same loss, AdamW), on the GPU PyTorch sees."""
    def median_ms(step) -> float:
        return float(bench.timed_calls(step, 3, reps)["median_ms"])

    def vk_step():
        session.step()
        session.wait()

    result = {"vkml": median_ms(vk_step)}
    if not torch.cuda.is_available():
        return result
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = copy.deepcopy(model.module).cuda()
    args = tuple(v.cuda() for v in model.inputs.values())
    tgt = target.cuda()
    for label, fn in (("eager", module), ("compile", torch.compile(module))):
        opt = torch.optim.AdamW(module.parameters(), lr=LR)

        def torch_step(fn=fn, opt=opt):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(fn(*args), tgt).backward()
            opt.step()
            torch.cuda.synchronize()
        try:
            result[label] = median_ms(torch_step)
        except Exception as e:  # torch.compile fails on some models: say so, keep the rest
            result[label + "_error"] = f"{type(e).__name__}"
    return result


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" if x else "0"


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [f"# Model zoo ({meta['size']}), {meta['date']}", "",
             f"Command: `{meta['command']}`. Device: {meta['device']}. Gates: forward and "
             f"3 AdamW steps rel L2 < {FORWARD_GATE:g}; gradients: PROTOCOL.md (per parameter "
             f"and total norm error < {GRAD_NORM_GATE:g}, cosine > {GRAD_COSINE_GATE:g}); the "
             "worst gradient's rel L2 is shown.", "",
             "| model | way | params | status | fwd vs torch | fwd vs ort | worst grad (rel L2, "
             "compared) "
             "| 3 AdamW steps | saved back | import s | compile s | vkml / eager / compile ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        status = r.status
        if r.status == "refused" and r.refused:
            status = "refused: " + ", ".join(f"{op} x{n}" for op, n in sorted(r.refused.items()))
        elif r.status in ("error", "refused") and r.error:
            status += ": " + r.error[:160].replace("|", "/")
        bench = " / ".join(f"{r.bench[k]:.2f}" for k in ("vkml", "eager", "compile")
                           if k in r.bench) or "-"
        lines.append(
            f"| {r.model} | {r.way} | {r.params:,} | {status} | {fmt(r.forward_torch)} | "
            f"{fmt(r.forward_ort)} | {fmt(r.grad_worst)} ({r.grads_compared}/"
            f"{r.grads_compared + r.grads_unmatched}) | {fmt(r.train)} | {fmt(r.saved)} | "
            f"{'-' if r.import_s is None else f'{r.import_s:.1f}'} | "
            f"{'-' if r.compile_s is None else f'{r.compile_s:.2f}'} | {bench} |")
    passed = sum(r.status == "pass" for r in rows)
    lines += ["", f"{passed} of {len(rows)} model-ways pass every gate."]
    return "\n".join(lines) + "\n"


def write(rows: list[Row], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"zoo-{meta['size']}.json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / f"zoo-{meta['size']}.md").write_text(markdown(rows, meta))


def merge(paths: list[Path], out: Path) -> int:
    runs = [json.loads(p.read_text()) for p in paths]
    sizes = {run["meta"]["size"] for run in runs}
    if len(sizes) != 1:
        raise SystemExit(f"--merge: the files hold sizes {sorted(sizes)}; merge one size")
    # Before --ways both expanded, "both" named one way: import_model's torch.export branch.
    rows = {(r["model"], r["way"]): Row(**r) for run in runs
            for r in [{**r, "way": "torch" if r["way"] == "both" else r["way"]}
                      for r in run["rows"]]}
    meta = {**runs[0]["meta"], "command": "; ".join(run["meta"]["command"] for run in runs),
            "date": ", ".join(sorted({run["meta"]["date"] for run in runs}))}
    write(list(rows.values()), meta, out)
    print(f"wrote {out / ('zoo-' + meta['size'] + '.md')} and .json ({len(rows)} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=zoo_models.SIZES, default="small")
    ap.add_argument("--only", help="comma-separated model names (default: all of "
                                   f"{', '.join(zoo_models.MODELS)})")
    ap.add_argument("--ways", default="both", help="onnx, torch or both")
    ap.add_argument("--bench", action="store_true", help="time training steps beside PyTorch")
    ap.add_argument("--import-only", action="store_true",
                    help="import both ways and report refusals; no numbers checked")
    ap.add_argument("--out", default="out/zoo", help="folder for zoo-<size>.json and .md")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="write one table of the rows of these zoo-<size>.json files (runs "
                         "cut into parts to fit a machine's time limit), later files winning")
    args = ap.parse_args(argv)
    if args.merge:
        return merge([Path(p) for p in args.merge], Path(args.out))
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    names = args.only.split(",") if args.only else list(zoo_models.MODELS)
    unknown = sorted(set(names) - set(zoo_models.MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; the zoo has {sorted(zoo_models.MODELS)}")
    ways = list(WAYS) if args.ways == "both" else args.ways.split(",")
    if set(ways) - set(WAYS):
        ap.error(f"--ways {args.ways!r}: give onnx, torch, onnx,torch or both")
    device = vkml.Device()
    rows: list[Row] = []
    meta = {"size": args.size, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python tools/zoo.py " + " ".join(argv or sys.argv[1:]),
            "device": getattr(device, "name", str(device)), "host": platform.node(),
            "torch": torch.__version__}
    out = Path(args.out)
    try:
        from tqdm import tqdm
        todo = tqdm([(n, w) for n in names for w in ways], desc="zoo", unit="model")
        for name, way in todo:
            todo.set_postfix_str(f"{name} ({way})")
            row = run_one(torch, name, way, args.size, args.bench, device, args.import_only)
            rows.append(row)
            tqdm.write(f"{name:30s} {way:6s} {row.status:8s} fwd {fmt(row.forward_torch)} "
                       f"grad {fmt(row.grad_worst)} train {fmt(row.train)} "
                       f"{row.error or ''}"[:200])
            write(rows, meta, out)  # after every row: a run cut short keeps what it did
    finally:
        device.close()
    print(f"wrote {out / f'zoo-{args.size}.md'} and .json")
    return 0 if all(r.status in ("pass", "imported") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
