"""tools/bench.py under one of the channels-last rules for accelerated inference's convolutions,
so a device call can time them side by side (one process each, each with a plan cache of its
own: the plan cache keys on vkml's sources, not on a rule set in a process):

    VKML_CACHE_DIR=/tmp/vc-free python3 tools/channels_last_ab.py free BENCH ARGS...
    VKML_CACHE_DIR=/tmp/vc-none python3 tools/channels_last_ab.py none BENCH ARGS...
    VKML_CACHE_DIR=/tmp/vc-all  python3 tools/channels_last_ab.py all  BENCH ARGS...

- free: the library's rule (kernels/conv.py CHANNELS_LAST_MIN, compiler/layouts.py: only where
  the copies cost the step nothing);
- none: every convolution on NCHW operands (channels-last off);
- all: every convolution CHANNELS_LAST_MIN takes, standalone copies included.
"""

import runpy
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]

from vkml.compiler import layouts  # noqa: E402
from vkml.kernels import conv  # noqa: E402

RULES = ("free", "none", "all")

if len(sys.argv) < 2 or sys.argv[1] not in RULES:
    raise SystemExit(f"usage: channels_last_ab.py {{{','.join(RULES)}}} [tools/bench.py args]")
rule = sys.argv[1]
if rule == "none":
    conv.CHANNELS_LAST_MIN = dict.fromkeys(conv.CHANNELS_LAST_MIN)
if rule == "all":
    layouts._where_copies_are_free = lambda nodes, roots, wants: wants
sys.argv = [str(TOOLS / "bench.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
