"""Snapshot what the compiler makes of the workload plans, to show a refactor changes none of it.

For each reference model (vkml/models: smollm2, smolvla_expert, unet, resnet, whisper_encoder)
x phase (train: loss + Adam; infer: outputs and loss) x target, the plan is lowered without any
device work and written as text: the plan dump (tensors, placements, dispatches between
barriers), the memory dump, and every kernel's WGSL. Targets:
- `lavapipe-strict`: this machine's device capabilities (a CPU driver: its loop limit, no
  cooperative matrices), precision f32;
- `gpu-strict`, `gpu-accelerated`: an H200's capabilities as far as codegen reads them (a
  discrete GPU, 48 KiB of shared memory, subgroups of 32, cooperative matrices, f16, no loop
  limit), precision f32 and f16: the twenty plans of the bench's full configs.
lavapipe runs the tests' tiny configs (the bench's full configs at the CPU driver's limits
split much the same way); the GPU targets run the full configs.

    python tools/plan_snapshot.py save DIR       # before the change
    python tools/plan_snapshot.py compare DIR    # after: names each file that differs
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import vkml  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.models import resnet, smollm2, smolvla_expert, unet, whisper_encoder  # noqa: E402

MODELS = {
    "smollm2": (smollm2, smollm2.SmolLM2Config, smollm2.tiny, {}),
    "smolvla_expert": (smolvla_expert, smolvla_expert.SmolVLAExpertConfig, smolvla_expert.tiny,
                       {}),
    "unet": (unet, unet.UNetConfig, unet.tiny, {}),
    "resnet": (resnet, resnet.resnet50, lambda: resnet.tiny("bottleneck"), {"bn": "eval"}),
    "whisper_encoder": (whisper_encoder, whisper_encoder.WhisperEncoderConfig,
                        whisper_encoder.tiny, {}),
}


def targets(device_caps: vkml.hal.Capabilities) -> dict[str, tuple[object, str, bool]]:
    """name -> (capabilities, precision, full config)."""
    gpu = dataclasses.replace(device_caps, device_name="NVIDIA H200", device_type="discrete",
                              max_shared_memory_bytes=49152, subgroup_size=32,
                              cooperative_matrix=True, shader_f16=True,
                              max_loop_iterations=None)
    return {"lavapipe-strict": (device_caps, "f32", False), "gpu-strict": (gpu, "f32", True),
            "gpu-accelerated": (gpu, "f16", True)}


def snapshot(model: str, phase: str, caps, precision: str, full: bool) -> str:
    module, full_config, tiny_config, infer_overrides = MODELS[model]
    cfg = full_config() if full else tiny_config()
    if phase == "infer":
        cfg = dataclasses.replace(cfg, **infer_overrides)
    built = module.build(cfg)
    if phase == "train":
        kwargs = {"loss": built.loss, "optimizer": vkml.Adam(lr=1e-3), "outputs": built.outputs}
    else:
        kwargs = {"outputs": {**built.outputs, "loss": built.loss}}
    stages = lower(built.graph, caps, precision=precision, **kwargs)
    text = "\n".join([stages.dump("plan"), stages.dump("memory"), stages.dump("wgsl")]) + "\n"
    # Labels name the user's line that built a node: this script's, which an edit moves.
    return re.sub(r"plan_snapshot\.py:\d+", "plan_snapshot.py", text)


def cases(device_caps) -> list[tuple[str, str, object, str, bool]]:
    return [(f"{target}-{model}-{phase}", model, phase, *spec)
            for target, spec in targets(device_caps).items()
            for model in MODELS for phase in ("train", "infer")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("save", "compare"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--only", default="", help="names containing this (e.g. smollm2)")
    opts = parser.parse_args()
    device_caps = vkml.Device().caps
    differ = 0
    out = opts.dir if opts.action == "save" else Path(tempfile.mkdtemp(prefix="plan-snapshot-"))
    out.mkdir(parents=True, exist_ok=True)
    for name, model, phase, caps, precision, full in cases(device_caps):
        if opts.only not in name:
            continue
        text = snapshot(model, phase, caps, precision, full)
        (out / f"{name}.txt").write_text(text)
        if opts.action == "compare":
            before = (opts.dir / f"{name}.txt").read_text()
            same = before == text
            differ += not same
            print(f"{name}: {'identical' if same else 'DIFFERS'}", flush=True)
            if not same:
                sys.stdout.writelines(list(difflib.unified_diff(
                    before.splitlines(True), text.splitlines(True), "before", "after", n=1))[:40])
        else:
            print(f"{name}: {len(text.splitlines())} lines", flush=True)
    if opts.action == "compare":
        print(f"{differ} differ; this run's files are under {out}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
