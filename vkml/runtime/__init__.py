"""Running a compiled plan: the device handle, the plan bound to it, chunked steps, profiling
and checkpoints."""
