"""Console progress (rich bars + one live summary line) and the run's log file."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from rich.console import Console, RenderableType
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

LOGGER_NAME = "mtprun"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def setup_logging(log_file: Path, console: Console) -> logging.Logger:
    """The `mtprun` logger: everything to `log_file` (appended), INFO and up to the console."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(_FILE_FORMAT))
    to_file.setLevel(logging.DEBUG)
    to_console = RichHandler(console=console, show_path=False, markup=False)
    to_console.setLevel(logging.INFO)
    logger.addHandler(to_file)
    logger.addHandler(to_console)
    return logger


def close_logging() -> None:
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


def summary_line(step: int, metrics: Mapping[str, float], labels: Mapping[str, str]) -> str:
    """`step 12 | reward 0.41 | loss 0.132 | ...`: the metrics named in `labels` (key ->
    label) that `metrics` has."""
    parts = [f"step {step}"]
    parts += [f"{label} {metrics[key]:.4g}" for key, label in labels.items() if key in metrics]
    return " | ".join(parts)


class RunProgress(Progress):
    """One bar per stage (warm-start SFT, RL) and a summary line of the newest step below."""

    def __init__(self, console: Console) -> None:
        self._summary = Text("")  # before super().__init__, which may already render
        super().__init__(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )

    def stage(self, name: str, total: int, done: int = 0) -> TaskID:
        return self.add_task(name, total=total, completed=done)

    def step_done(self, task: TaskID, summary: str) -> None:
        self._summary = Text(summary, style="cyan")
        self.advance(task)

    def get_renderables(self) -> Iterable[RenderableType]:
        yield from super().get_renderables()
        yield self._summary
