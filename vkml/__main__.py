"""Command line: `python -m vkml <command>`.

    demo    train an MLP on procedurally drawn shapes, report test accuracy, save weights and a
            figure (loss curve and labelled test images) under out/ (vkml/demo.py)
    dump    run a script up to its vkml.compile call and print a compiler stage
            (graph, rewritten, split, plan, memory, wgsl, spirv) (vkml/dump.py)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vkml import demo as demo_command
from vkml import dump as dump_command
from vkml.errors import DeviceError


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vkml",
                                     description="vkml: a Vulkan-native ML engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = commands.add_parser(
        "demo", help="train an MLP on procedurally drawn shapes and save a figure",
        description="Train a 256-128-64-6 MLP on 16x16 images of six shapes, print the test "
                    "accuracy and the time per step, and write out/mlp_shapes.safetensors and "
                    "(with matplotlib installed) out/mlp_shapes.png.")
    demo_command.add_arguments(demo)
    demo.set_defaults(run=demo_command.run)
    dump = commands.add_parser("dump", help="print a stage of what a script compiles",
                               description=dump_command.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    dump_command.add_arguments(dump)
    dump.set_defaults(run=dump_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.run(args)
    except DeviceError as e:
        # No usable device is an environment problem, not a bug: the message, not a traceback.
        print(f"python -m vkml {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
