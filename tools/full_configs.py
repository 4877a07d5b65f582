"""Each reference model (vkml/models/) at its FULL config (tools/PROTOCOL.md's workloads): build the
graph, compile a training session (loss + Adam), run training steps on the default device, and
report build, compile and step times, dispatch counts and memory. Results go to
out/full_configs.json (rewritten after every model, so a run stopped part-way keeps what it
measured).

    python tools/full_configs.py [--models smollm2,resnet50,...] [--steps 1] [--out PATH]

Models: smollm2 (SmolLM2-135M, 1 x 128 tokens), smolvla_expert (1 x 50 actions), unet (2 x 4 x
32 x 32), resnet50 (4 x 3 x 224 x 224, batch norm in training form), resnet18, whisper_encoder
(whisper-tiny's encoder, 1 x 80 x 3000). `--tiny` runs the tests' tiny configs instead (a smoke
test of this script). `--fused` uses the flash-style attention kernel where a model has one.
`--check` also applies tools/PROTOCOL.md's gates at the full config: the first step's outputs, loss
and every gradient against the plain-PyTorch model of tests/torch_reference.py (float64, CPU)
on the same weights and inputs (the session then keeps its gradients, which changes its memory
plan: the memory figures of a --check run are not the plain training step's).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import vkml  # noqa: E402
from vkml.models import resnet, smollm2, smolvla_expert, unet, whisper_encoder  # noqa: E402

MODELS = {
    "smollm2": (smollm2.build, smollm2.SmolLM2Config, smollm2.tiny),
    "smolvla_expert": (smolvla_expert.build, smolvla_expert.SmolVLAExpertConfig,
                       smolvla_expert.tiny),
    "unet": (unet.build, unet.UNetConfig, unet.tiny),
    "resnet50": (resnet.build, resnet.resnet50, lambda: resnet.tiny("bottleneck")),
    "resnet18": (resnet.build, resnet.resnet18, lambda: resnet.tiny("basic")),
    "whisper_encoder": (whisper_encoder.build, whisper_encoder.WhisperEncoderConfig,
                        whisper_encoder.tiny),
}


def reference(name: str, cfg):
    sys.path.insert(0, str(REPO / "tests"))
    import torch_reference as ref

    return {"smollm2": ref.SmolLM2, "smolvla_expert": ref.SmolVLAExpert, "unet": ref.UNet,
            "resnet50": ref.ResNet, "resnet18": ref.ResNet,
            "whisper_encoder": ref.WhisperForAudioClassification}[name](cfg)


def gates(name, cfg, session, params, inputs) -> dict:
    """tools/PROTOCOL.md's forward and backward gates for the step just run, vs float64 torch."""
    import torch

    t0 = time.perf_counter()
    module = reference(name, cfg).double()
    module.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()},
                           strict=False)
    outputs, loss = module(**{k: torch.tensor(v if v.dtype == np.int32 else v.astype(np.float64))
                              for k, v in inputs.items()})
    loss.backward()

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    forward = {"loss": rel(session.read("loss"), loss.item())}
    forward |= {k: rel(session.read(k), v.detach().numpy()) for k, v in outputs.items()}
    torch_params = dict(module.named_parameters())
    total = ref_total = 0.0
    worst = ("", 0.0)
    min_cosine = 1.0
    for n in (n for n in params if n in session.plan.grads):  # frozen ones have no gradient
        got, want = session.grad(n).astype(np.float64).ravel(), torch_params[n].grad.numpy().ravel()
        gn, wn = np.linalg.norm(got), np.linalg.norm(want)
        total, ref_total = total + gn * gn, ref_total + wn * wn
        err = abs(gn - wn) / wn if wn > 0 else gn
        if err > worst[1]:
            worst = (n, float(err))
        if wn > 0 and gn > 0:
            min_cosine = min(min_cosine, float(got @ want / (gn * wn)))
    grad_total = abs(np.sqrt(total) - np.sqrt(ref_total)) / np.sqrt(ref_total)
    result = {"forward_rel_l2": forward, "grad_total_norm_error": float(grad_total),
              "grad_worst_param_norm_error": worst, "grad_min_cosine": min_cosine,
              "reference_s": time.perf_counter() - t0}
    result["pass"] = bool(max(forward.values()) < 1e-2 and grad_total < 5e-2 and worst[1] < 5e-2
                          and min_cosine > 0.99)
    return result


def run(name: str, device: vkml.Device, steps: int, tiny: bool, fused: bool,
        check: bool = False) -> dict:
    build, full, small = MODELS[name]
    cfg = small() if tiny else full()
    if fused and hasattr(cfg, "fused_attention"):
        cfg = replace(cfg, fused_attention=True)
    row: dict = {"model": name, "config": "tiny" if tiny else "full", "settings": asdict(cfg)}
    t0 = time.perf_counter()
    built = build(cfg)
    row["build_s"] = time.perf_counter() - t0
    row["parameters"] = int(sum(p.size for p in built.graph.params.values()))
    print(f"{name}: {row['parameters']:,} parameters, graph of {len(built.graph.nodes)} nodes "
          f"built in {row['build_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    session = vkml.compile(built.graph, loss=built.loss, optimizer=vkml.Adam(lr=1e-4),
                           outputs=built.outputs, device=device, keep_grads=check or None)
    row["compile_s"] = time.perf_counter() - t0
    plan = session.plan
    memory = plan.memory_report()
    row.update(dispatches=len(plan.dispatches), barriers=plan.barrier_count,
               kernels=session.kernel_count, logical_bytes=memory["logical"],
               physical_bytes=memory["physical"])
    print(f"  compiled in {row['compile_s']:.1f} s: {row['dispatches']} dispatches, "
          f"{row['kernels']} kernels, {memory['physical'] / 2**20:.0f} MiB allocated for "
          f"{memory['logical'] / 2**20:.0f} MiB of tensors", flush=True)
    inputs = built.sample_inputs(np.random.default_rng(0))
    row["step_s"], row["loss"] = [], []
    initial = session.params() if check else None
    for step in range(max(steps, 1 if check else 0)):
        for k, v in inputs.items():
            session.set_input(k, v)
        t0 = time.perf_counter()
        session.step()
        session.wait()
        row["step_s"].append(time.perf_counter() - t0)
        row["loss"].append(float(session.read("loss")))
        print(f"  training step in {row['step_s'][-1]:.1f} s, loss {row['loss'][-1]:.4f}",
              flush=True)
        if check and step == 0:
            row["gates"] = gates(name, cfg, session, initial, inputs)
            print(f"  gates against float64 PyTorch: {row['gates']}", flush=True)
            del initial
    row["finite"] = bool(np.all(np.isfinite(row["loss"])))
    session.close()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "full_configs.json")
    opts = parser.parse_args()
    device = vkml.Device()
    print(f"device: {device.name} ({device.backend_name})", flush=True)
    result = {"engine": "vkml", "device": device.name, "backend": device.backend_name,
              "host": platform.node(), "mode": "strict f32", "optimizer": "Adam(lr=1e-4)",
              "rows": []}
    for name in opts.models.split(","):
        result["rows"].append(run(name, device, opts.steps, opts.tiny, opts.fused,
                                  opts.check))
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
