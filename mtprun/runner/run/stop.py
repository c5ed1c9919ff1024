"""Graceful stop on Ctrl-C / SIGTERM: the first signal asks the loop to stop after the current
step (which is then checkpointed, so a resume continues exactly); a second Ctrl-C stops now."""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger("mtprun")


class StopRequest:
    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Take SIGINT and SIGTERM; again after a library replaced the handlers (Ray's driver
        sets its own SIGTERM handler, which exits at once), keeping the first previous ones."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous.setdefault(sig, signal.signal(sig, self._on_signal))
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        log.warning(
            "%s: stopping after the current step and saving a checkpoint "
            "(press Ctrl-C again to stop at once)",
            name,
        )

    @staticmethod
    def shield() -> None:
        """Ignore further signals while shutting down, so cleanup is not cut short."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
