"""`python -m vkml dump [--stage S] [--out DIR] <script.py | module> [args]`: show what a
program compiles.

The program runs until its first `vkml.compile(...)` call, which stops it (nothing is compiled or
trained); that call's graph and options are lowered stage by stage (vkml/compiler/stages.py), and
the chosen stage is printed, or written under `--out` (SPIR-V always is, being binary).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import warnings
from pathlib import Path

from vkml.compiler import stages as compiler_stages
from vkml.compiler.stages import Stages, lower
from vkml.errors import VkmlError
from vkml.runtime.device import default_device
from vkml.session import CompileCalled, stop_at_compile

# The compiler's stages, then the Vulkan backend's translation of each kernel
STAGES = (*compiler_stages.STAGES, "spirv")


def capture(target: str, argv: list[str]) -> CompileCalled:
    """Run `target` (a .py path or a module name) until it calls vkml.compile; return that
    call's graph, device and options."""
    saved_argv = sys.argv
    sys.argv = [target, *argv]
    try:
        with stop_at_compile():
            if target.endswith(".py") or os.path.sep in target:
                runpy.run_path(target, run_name="__main__")
            else:
                with warnings.catch_warnings():  # re-running an imported package's __main__
                    warnings.simplefilter("ignore", RuntimeWarning)
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
    except CompileCalled as call:
        return call
    finally:
        sys.argv = saved_argv
    raise VkmlError(f"{target} finished without calling vkml.compile: nothing to dump")


def stages_of(target: str, argv: list[str]) -> Stages:
    """Every compiler stage of what `target` compiles first, for the device it asks for."""
    call = capture(target, argv)
    return lower(call.graph, (call.device or default_device()).caps, call.options)


def spirv(stages: Stages) -> dict[str, bytes]:
    """Each kernel's SPIR-V, as the Vulkan backend translates it (naga; a bfloat16 kernel's
    f16 then made bfloat16, vk/spirv.py)."""
    from vkml.hal.kernel import BFLOAT16_MARK
    from vkml.vk import compile_wgsl
    from vkml.vk.spirv import to_bfloat16

    spirv = {}
    for name, wgsl in stages.kernels().items():
        code = compile_wgsl(wgsl, name)
        spirv[name] = to_bfloat16(code) if wgsl.startswith(BFLOAT16_MARK) else code
    return spirv


def show(stages: Stages, stage: str) -> str:
    if stage == "spirv":
        return "\n".join(f"{name}: {len(code)} bytes of SPIR-V"
                         for name, code in spirv(stages).items())
    return stages.dump(stage)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a Python script or module that calls vkml.compile")
    parser.add_argument("--stage", choices=STAGES, default="plan",
                        help="which stage to show (default: %(default)s)")
    parser.add_argument("--out", type=Path,
                        help="also write it under this folder (SPIR-V: default out/dump)")
    # Everything after the target is the target's own command line, as with `python -m`.
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")


def run(opts: argparse.Namespace) -> int:
    if opts.target.endswith(".py") and not os.path.isfile(opts.target):
        print(f"python -m vkml dump: no such script {opts.target!r}", file=sys.stderr)
        return 2
    stages = stages_of(opts.target, opts.args)
    if opts.stage == "spirv" or opts.out:
        out = opts.out or Path("out") / "dump"
        out.mkdir(parents=True, exist_ok=True)
        if opts.stage == "spirv":
            for name, code in spirv(stages).items():
                (out / f"{name}.spv").write_bytes(code)
        elif opts.stage == "wgsl":
            for name, wgsl in stages.kernels().items():
                (out / f"{name}.wgsl").write_text(wgsl)
        else:
            (out / f"{opts.stage}.txt").write_text(show(stages, opts.stage) + "\n")
        print(f"wrote the {opts.stage} stage under {out}/")
    print(show(stages, opts.stage))
    return 0
