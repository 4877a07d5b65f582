"""`python -m vkml dump [--stage S] [--out DIR] <script.py | module> [args]`: show what a
program compiles.

The program runs until its first `vkml.compile(...)` call; that call's graph and arguments are
captured (the program stops there, nothing is trained) and lowered stage by stage, and the
chosen stage is printed, or written under `--out` (SPIR-V always is, being binary).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

from vkml import session as session_module
from vkml.compiler import stages as compiler_stages
from vkml.compiler.stages import Stages, lower
from vkml.errors import VkmlError
from vkml.graph import Graph
from vkml.runtime.device import Device, default_device

# The compiler's stages, then the Vulkan backend's translation of each kernel
STAGES = (*compiler_stages.STAGES, "spirv")


def spirv(stages: Stages) -> dict[str, bytes]:
    """Each kernel's SPIR-V, as the Vulkan backend translates it (naga)."""
    from vkml.vk import compile_wgsl

    return {name: compile_wgsl(wgsl, name) for name, wgsl in stages.kernels().items()}


def show(stages: Stages, stage: str) -> str:
    if stage == "spirv":
        return "\n".join(f"{name}: {len(code)} bytes of SPIR-V"
                         for name, code in spirv(stages).items())
    return stages.dump(stage)


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        self.args_, self.kwargs = args, kwargs


COMPILE_PARAMETERS = ("loss", "optimizer", "device", "outputs", "rewrite", "keep_grads",
                      "trainable", "precision", "check_finite")


def capture(target: str, argv: list[str]) -> tuple[Graph, dict[str, Any]]:
    """Run `target` (a .py path or a module name) until it calls vkml.compile; return the
    call's graph and its other arguments by name (as vkml.compile names them)."""
    import vkml

    def intercept(*args: Any, **kwargs: Any) -> None:
        raise _Captured(args, kwargs)

    saved = vkml.compile, session_module.compile, sys.argv
    vkml.compile = session_module.compile = intercept  # type: ignore[assignment]
    sys.argv = [target, *argv]
    try:
        if target.endswith(".py") or os.path.sep in target:
            runpy.run_path(target, run_name="__main__")
        else:
            with warnings.catch_warnings():  # re-running an imported package's __main__ is fine
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except _Captured as call:
        graph, *rest = call.args_
        return graph, dict(zip(COMPILE_PARAMETERS, rest)) | call.kwargs
    finally:
        vkml.compile, session_module.compile, sys.argv = saved
    raise VkmlError(f"{target} finished without calling vkml.compile: nothing to dump")


def stages_of(target: str, argv: list[str], device: Device | None = None) -> Stages:
    graph, options = capture(target, argv)
    device = options.pop("device", None) or device or default_device()
    return lower(graph, device.caps, **options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a Python script or module that calls vkml.compile")
    parser.add_argument("--stage", choices=STAGES, default="plan",
                        help="which stage to show (default: %(default)s)")
    parser.add_argument("--out", type=Path,
                        help="also write it under this folder (SPIR-V: default out/dump)")
    # Everything after the target is the target's own command line, as with `python -m`.
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")


def run(opts: argparse.Namespace) -> int:
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
