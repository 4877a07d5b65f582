"""Imported models against the hand-built ones, in one process: does a model brought in from
PyTorch (through torch.export, or exported to ONNX) train as fast as vkml's own?

    python tools/import_bench.py                 # GPU: ResNet-50 4x224, SmolLM2-135M 1x128
    python tools/import_bench.py --tiny          # the same code at test size (lavapipe)

Per workload: torchvision's resnet50 (train mode: batch statistics, as vkml.models.resnet's
default) and Hugging Face's LlamaForCausalLM at SmolLM2-135M's configuration (SDPA attention,
tied embeddings), imported both ways, beside vkml.models' hand-built twin. Every session
trains with Adam(lr=1e-4) on the same loss (cross-entropy; the LLaMA one through
vkml.models.smollm2.next_token_loss as the hand-built model). Reported: compile time, median
and min wall time of `step(); wait()` after warm-up, the dispatch count of the plan, and the
ratio to the hand-built model. Output: out/import_bench-<size>.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vkml first
import bench  # noqa: E402
import zoo  # noqa: E402
import zoo_models  # noqa: E402

import vkml  # noqa: E402
from vkml.models import resnet, smollm2  # noqa: E402


def timed_steps(session, feeds: dict[str, np.ndarray], warmup: int, reps: int) -> dict:
    for name, value in feeds.items():
        session.set_input(name, value)
    timed = bench.timed_steps(session, warmup, reps)
    return {"median_ms": timed["median_ms"], "min_ms": timed["min_ms"]}


def run(label: str, graph, loss, feeds, device, warmup: int, reps: int) -> dict:
    t0 = time.perf_counter()
    s = vkml.compile(graph, loss=loss, optimizer=vkml.Adam(lr=1e-4), device=device)
    compile_s = time.perf_counter() - t0
    row = {"model": label, "compile_s": compile_s, "dispatches": len(s.plan.dispatches),
           **timed_steps(s, feeds, warmup, reps)}
    s.close()
    print(f"  {label:28s} {row['median_ms']:9.3f} ms  compile {compile_s:5.2f} s  "
          f"{row['dispatches']} dispatches", flush=True)
    return row


def imported(torch, module, example: tuple, way: str, tmp: Path):
    if way == "torch.export":
        return vkml.import_torch(module, args=example, training=True)
    path = tmp / "model.onnx"
    names = [f"input{i}" for i in range(len(example))]
    model = zoo_models.ZooModel(module, dict(zip(names, example)), "")
    zoo.export_onnx(torch, model, path, training=module.training)
    return vkml.import_onnx(str(path), training=True)


def resnet_rows(torch, tiny: bool, device, warmup, reps, tmp) -> list[dict]:
    # torchvision's ResNet class fixes the widths (64 to 2048), so the tiny pair keeps them and
    # shrinks depth and image only: the same model on both sides.
    cfg = (dataclasses.replace(resnet.tiny(), widths=(64, 128, 256, 512), stem_width=64,
                               image_size=32) if tiny else resnet.ResNetConfig())
    built = resnet.build(cfg)
    rng = np.random.default_rng(0)
    feeds = built.sample_inputs(rng)
    rows = [run("resnet50 hand-built", built.graph, built.loss, feeds, device, warmup, reps)]
    tv = zoo_models.import_torchvision()
    torch.manual_seed(0)
    if tiny:
        module = tv.models.resnet.ResNet(tv.models.resnet.Bottleneck, list(cfg.layers),
                                         num_classes=cfg.num_classes)
    else:
        module = tv.models.resnet50(weights=None)
    module.train()
    x = torch.from_numpy(feeds["x"])
    for way in ("torch.export", "onnx"):
        imp = imported(torch, module, (x,), way, tmp)
        g = imp.graph
        (in_name,), (logits,) = list(imp.inputs), list(imp.outputs.values())
        labels = g.input("labels", (cfg.batch,), "i32")
        rows.append(run(f"resnet50 imported ({way})", g, g.cross_entropy(logits, labels),
                        {in_name: feeds["x"], "labels": feeds["labels"]}, device, warmup, reps))
    return rows


def llama_rows(torch, tiny: bool, device, warmup, reps, tmp) -> list[dict]:
    from bench_hf import llama_config
    from transformers import LlamaForCausalLM
    cfg = smollm2.tiny() if tiny else smollm2.SmolLM2Config()
    built = smollm2.build(cfg)
    feeds = built.sample_inputs(np.random.default_rng(0))
    rows = [run("smollm2 hand-built", built.graph, built.loss, feeds, device, warmup, reps)]
    torch.manual_seed(0)
    module = zoo_models.FirstOutput(LlamaForCausalLM(llama_config(cfg)), "logits").eval()
    ids = torch.from_numpy(feeds["ids"].astype(np.int64))
    for way in ("torch.export", "onnx"):
        try:
            imp = imported(torch, module, (ids,), way, tmp)
        except Exception as e:  # an exporter or importer failure is a row, not the end
            print(f"  smollm2 imported ({way}): {type(e).__name__}: {e}"[:300], flush=True)
            rows.append({"model": f"smollm2 imported ({way})",
                         "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        g = imp.graph
        (in_name,), (logits,) = list(imp.inputs), list(imp.outputs.values())
        rows_n = cfg.batch * cfg.seq
        targets = g.input("targets", (rows_n,), "i32")
        loss = smollm2.next_token_loss(g, g.reshape(logits, (rows_n, cfg.vocab_size)), targets)
        rows.append(run(f"smollm2 imported ({way})", g, loss,
                        {in_name: feeds["ids"], "targets": feeds["targets"]}, device, warmup,
                        reps))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="test-size configurations")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="resnet,llama",
                    help="comma-separated: resnet (torchvision resnet50 against "
                         "vkml/models/resnet.py), llama (LlamaForCausalLM against smollm2.py)")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    pairs = {"resnet": resnet_rows, "llama": llama_rows}
    unknown = sorted(set(args.only.split(",")) - set(pairs))
    if unknown:
        ap.error(f"--only: unknown {unknown}; give some of {sorted(pairs)}")
    import tempfile

    import torch
    zoo_models.usable()  # transformers imports torchvision where installed (torchvision_compat)
    device = vkml.Device()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            fn = pairs[name]
            print(name, flush=True)
            rows += fn(torch, args.tiny, device, args.warmup, args.reps, Path(tmp))
    device.close()
    base = {}
    lines = ["| model | median ms | min ms | / hand-built | compile s | dispatches |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error'][:120]} | | | | |")
            continue
        key = r["model"].split()[0]
        base.setdefault(key, r["median_ms"])
        lines.append(f"| {r['model']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
                     f"{r['median_ms'] / base[key]:.2f}x | {r['compile_s']:.2f} | "
                     f"{r['dispatches']} |")
    size = "tiny" if args.tiny else "full"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"import_bench-{size}.json").write_text(json.dumps(rows, indent=1))
    (out / f"import_bench-{size}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
