"""Every Khronos validation-layer message from a GPU's kernels, strict and accelerated.

The tests run under the validation layer on lavapipe, which has no cooperative matrices, so the
accelerated kernels (f16, `VK_KHR_cooperative_matrix`) are only ever checked on a real GPU. This
runs, with the layer on: one matmul in each precision (checked against float64; "bf16" where
the device has bfloat16 cooperative matrices), then a step of the workloads' training and
inference graphs (tools/bench.py; Whisper and SmolVLA at their full configs, the others tiny)
in each accelerated precision where the device has cooperative matrices, and prints every
message, counted.

    VKML_VALIDATION=1 python tools/validation_check.py

The lent H200 has no layer installed; Debian trixie's (vulkan-validationlayers 1.4.309, which
knows cooperative matrices; it needs libstdc++6 14, from trixie too) unpacks beside it:
`dpkg -x` both .deb files into a folder, then VK_LAYER_PATH=<folder>/usr/share/vulkan/
explicit_layer.d and LD_LIBRARY_PATH=<folder>/usr/lib/x86_64-linux-gnu (tools/KERNELS.md).
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import WORKLOADS, session_args  # noqa: E402

import vkml  # noqa: E402

# at full size: Whisper's products take cooperative tiles, SmolVLA's attention the fused
# cooperative kernel (kernels/attention.py); small enough to be quick
FULL = {"whisper_encoder", "smolvla_expert"}


def main() -> int:
    if (os.environ.get("VKML_VALIDATION") != "1"
            and "VK_LAYER_KHRONOS_validation" not in os.environ.get("VK_INSTANCE_LAYERS", "")):
        raise SystemExit("the validation layer is off: run with VKML_VALIDATION=1")
    device = vkml.Device()
    coop = device.caps.cooperative_matrix and device.caps.shader_f16
    print(f"{device}: cooperative matrices {coop}", flush=True)
    rng = np.random.default_rng(0)
    precisions = ("f32", *(["f16"] if coop else []),
                  *(["bf16"] if device.caps.bf16_cooperative_matrix else []))
    for precision in precisions:
        a = rng.standard_normal((512, 384)).astype(np.float32)
        b = rng.standard_normal((384, 256)).astype(np.float32)
        g = vkml.Graph()
        product = g.matmul(g.param("a", a.shape, init=a), g.param("b", b.shape, init=b))
        g.output("c", product.relu())
        session = vkml.compile(g, device=device, precision=precision)
        session.step()
        error = np.abs(session.read("c") - np.maximum(a.astype(np.float64) @ b, 0)).max()
        kernels = [d.kernel.name for d in session.plan.dispatches]
        print(f"matmul {precision}: {kernels}, largest error {error:.2e}", flush=True)
        session.close()
    for name, workload in WORKLOADS.items():
        for phase, precision in [(p, q) for p in ("train", "infer")
                                 for q in precisions[1:] or precisions]:
            built = workload.build(name not in FULL, phase)
            session = vkml.compile(built.graph, device=device, precision=precision,
                                   **session_args(vkml, built, phase))
            for key, value in built.sample_inputs(np.random.default_rng(0)).items():
                session.set_input(key, value)
            session.step()
            session.wait()
            session.close()
            print(f"{name} {phase} {precision}: messages so far "
                  f"{len(device.backend.validation_messages)}", flush=True)
    messages = device.backend.validation_messages
    print(f"{len(messages)} messages")
    for text, count in collections.Counter(m[:400] for m in messages).most_common():
        print(f"{count} x {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
