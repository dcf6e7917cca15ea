"""Graceful stop on SIGTERM / SIGINT: the signal only sets a flag; the loop finishes the optimizer step,
writes a checkpoint and exits. A second signal stops at once."""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Within this context, SIGTERM and SIGINT set ``received`` (the signal number) instead of stopping the
    process. A second signal restores the previous handlers and is re-delivered, so an impatient second
    Ctrl-C or a supervisor's follow-up SIGTERM still ends the process."""

    def __init__(self):
        self.received = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received:
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signum

    @staticmethod
    def exit_code(signum: int) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (signum or signal.SIGTERM)
