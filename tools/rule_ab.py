"""tools/bench.py under one variant of a compiler rule, so a device call can time variants side
by side: one process each, each with a plan cache of its own (the plan cache keys on vkml's
sources, not on a rule changed in a process):

    VKML_CACHE_DIR=/tmp/vc-a python3 tools/rule_ab.py VARIANT [tools/bench.py args]

Variants (VARIANTS):
- library: the rules as they are;
- chlast-none: every convolution on NCHW operands (kernels/conv.py CHANNELS_LAST_MIN off);
- chlast-all: every convolution CHANNELS_LAST_MIN takes channels-last, standalone copies
  included (compiler/layouts.py's rule, only where the copies come free, off);
- unsplit-rows-N: products of at most N rows are never split (kernels/gemm.py `splits`),
  so no sum dispatch follows them;
- unsplit32-rows-N: the same on 32 x 32 tiles, the smallest (more workgroups unsplit).
"""

import re
import runpy
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]

from vkml.compiler import layouts  # noqa: E402
from vkml.kernels import conv, gemm  # noqa: E402

VARIANTS = ("library", "chlast-none", "chlast-all", "unsplit-rows-N", "unsplit32-rows-N")


def unsplit(rows: int, smallest: bool) -> None:
    splits, choose = gemm.splits, gemm.choose

    def few_rows_whole(m, n, k, z, caps, *args, **kwargs):
        return 1 if m <= rows and not gemm.on_cpu(caps) else splits(m, n, k, z, caps, *args,
                                                                      **kwargs)

    def smallest_tiles(m, n, k, z, caps, *args, **kwargs):
        chosen = choose(m, n, k, z, caps, *args, **kwargs)
        if m > rows or gemm.on_cpu(caps):
            return chosen
        family = gemm.COOP if isinstance(chosen, gemm.CoopTiling) else (
            gemm.STAGED_F16 if gemm.in_f16(chosen) else gemm.STAGED)
        return family[-1]

    gemm.splits = few_rows_whole
    if smallest:
        gemm.choose = smallest_tiles


variant = sys.argv[1] if len(sys.argv) > 1 else ""
rows = re.fullmatch(r"(unsplit32|unsplit)-rows-(\d+)", variant)
if variant == "chlast-none":
    conv.CHANNELS_LAST_MIN = dict.fromkeys(conv.CHANNELS_LAST_MIN)
elif variant == "chlast-all":
    layouts._where_copies_are_free = lambda nodes, roots, wants: wants
elif rows:
    unsplit(int(rows[2]), rows[1] == "unsplit32")
elif variant != "library":
    raise SystemExit(f"usage: rule_ab.py {{{','.join(VARIANTS)}}} [tools/bench.py args]")
sys.argv = [str(TOOLS / "bench.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
