"""Ctrl-C held back across the sections where an exception would leave vkml's bookkeeping and
the queue disagreeing.

Python raises KeyboardInterrupt in the main thread between any two bytecodes. Landing between
`vkQueueSubmit` returning and the backend recording the timeline value it signalled, it left
the next submission signalling that value again and resubmitting a command buffer still pending
(the validation layer's VUID-VkSubmitInfo-pSignalSemaphores-03242 and
VUID-vkQueueSubmit-pCommandBuffers-00071); landing between a step's pieces, it left a step half
submitted. Inside `deferred_interrupts()` a SIGINT is only noted; it is raised as the outermost
such block ends, so it lands before the submission or after all of it is recorded.

Only the main thread receives Python's signals, so other threads need nothing; a SIGINT handler
that is not Python's (ignored, the default action, or one installed from C) is left alone.
"""

from __future__ import annotations

# signal's C module: signal.signal/getsignal wrap these to convert handlers to enums, with an
# exception caught per Python handler converted, which made them 15 times slower here.
import _signal
import threading
from types import FrameType, TracebackType
from typing import Any


class _Deferral:
    """The context manager; its state is the main thread's alone (no other thread changes it).
    A class rather than a generator: it runs around every submission."""

    def __init__(self) -> None:
        self.depth = 0  # blocks open in the main thread
        self.previous: Any = None  # the handler the outermost block replaced, if it did
        self.held: list[tuple[int, FrameType | None]] = []  # the SIGINT noted meanwhile

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.held[:] = [(signum, frame)]

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth:  # the outermost block raises it
            self.depth += 1
            return
        previous = _signal.getsignal(_signal.SIGINT)
        if callable(previous):
            self.held.clear()  # noted by a block whose own end was interrupted: raised then
            _signal.signal(_signal.SIGINT, self._note)
            self.previous = previous
        # Counted only now: a SIGINT raised above leaves no open block behind.
        self.depth = 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth -= 1
        previous = self.previous
        if self.depth or previous is None:
            return
        self.previous = None
        _signal.signal(_signal.SIGINT, previous)
        if self.held:
            (signum, frame), = self.held
            self.held.clear()
            previous(signum, frame)  # Python's default handler raises KeyboardInterrupt


_deferral = _Deferral()


def deferred_interrupts() -> _Deferral:
    """`with deferred_interrupts(): ...` runs the block with SIGINT held back (main thread
    only) and raises it after."""
    return _deferral
