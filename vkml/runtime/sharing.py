"""Parameters shared between two sessions of one device: `vkml.compile(g,
share_params_with=owner)` binds the new session's parameters to the owner's memory, by name, so
an inference session sees a training session's weights with no copy.

Why this design (and not a forward pass on the training session itself while its chunked step
is in progress): a forward pass writes activations, and the training session's memory plan
reuses activation memory within its step, so a forward run between two pieces of the step would
overwrite what the step's backward pass still reads. A second session has activations of its
own; only the parameters are the same bytes.

Hazards, and why results stay deterministic: both sessions submit to the same queue, and every
vkml program starts with a global barrier (earlier compute and transfer writes before its reads
and writes), so a step always sees the parameters as of the submissions before it, and an
update waits for the reads submitted before it. What could go wrong is a step seeing HALF an
update: the training step's updates are spread over its backward levels, so a chunked training
step may have updated some parameters and not yet others, and a chunked inference step whose
pieces straddle an update would see some layers old and some new. Both are refused (InputError)
at submission, before anything is queued:
- a sharing session's step may not start while its owner is part-way through its updates
  (`owner.updating`; a whole step() is never part-way);
- the owner may not submit a piece that writes parameters while a sharing session's chunked
  step is part-way submitted, nor set_param() or load() then.
So every step of the sharing session reads one consistent set of parameters: those of the last
update fully submitted before its first piece.
"""

from __future__ import annotations

from vkml.compiler.plan import Plan
from vkml.errors import GraphError


def match_params(plan: Plan, owner: Plan) -> dict[int, int]:
    """This plan's parameter slots -> the owner's, for every parameter name both have (same
    shape and dtype, else GraphError)."""
    if plan.optimizer is not None:
        raise GraphError("share_params_with: a session with an optimizer would write the "
                         "shared parameters too; only one session (the owner) may update them")
    shared, problems = {}, []
    for name, slot in plan.params.items():
        other = owner.params.get(name)
        if other is None:
            continue
        mine, theirs = plan.slots[slot], owner.slots[other]
        if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
            problems.append(f"'{name}' is {mine.dtype}{list(mine.shape)} here and "
                            f"{theirs.dtype}{list(theirs.shape)} in the owner")
        shared[slot] = other
    if problems:
        raise GraphError("share_params_with: parameters differ: " + "; ".join(problems))
    if not shared:
        raise GraphError(f"share_params_with: no parameter names in common (this graph has "
                         f"{sorted(plan.params)[:5]}..., the owner {sorted(owner.params)[:5]}...)")
    return shared
