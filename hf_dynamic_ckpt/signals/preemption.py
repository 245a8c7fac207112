"""`PreemptionFlag`: SIGTERM/SIGUSR1 set a flag; the save happens at the next step boundary."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


class PreemptionFlag:
    """Signal handlers that only set a flag; the save happens at the next step boundary.

    Any previous Python handler is chained (called after the flag is set), so a
    framework's own handler keeps working. The default action (terminate) is *not*
    chained: not dying immediately is the point. `install()` and `uninstall()` are
    idempotent; handlers can only be installed from the main thread.

    Args:
        signals (`Iterable[str | int]`, *optional*, defaults to `("SIGTERM", "SIGUSR1")`).

    Example:
        ```python
        >>> flag = PreemptionFlag()
        >>> flag.install()
        >>> if flag.is_set: ...   # at a step boundary: save once, then exit
        >>> flag.uninstall()
        ```
    """

    def __init__(self, signals: Iterable[str | int] = ("SIGTERM", "SIGUSR1")) -> None:
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals]
        self._previous: dict[signal.Signals, Any] = {}
        self._event = threading.Event()
        self.signum: int | None = None

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def set(self, signum: int | None = None) -> None:
        """Raise the flag by hand (e.g. from a scheduler's HTTP notice)."""
        self.signum = signum
        self._event.set()

    def clear(self) -> None:
        self.signum = None
        self._event.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        # No logging here: a handler may interrupt code that holds the logging lock.
        self.set(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def install(self) -> bool:
        """Install the handlers; returns `False` (and logs) when not on the main thread."""
        if self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionFlag.install() called off the main thread: preemption signals are not watched.")
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back where ours is still the active one (idempotent)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            else:
                logger.debug("handler of %s was replaced after install; leaving it", sig.name)
        self._previous = {}

    def __enter__(self) -> PreemptionFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
