"""`tracking:` where MLflow records the run."""

from pydantic import Field

from mtprun.spec.base import Section


class TrackingSection(Section):
    """Where MLflow records params, metrics and artifacts."""

    uri: str | None = Field(
        None,
        description="MLflow tracking URI; null means sqlite:///<run_dir>/mlflow.db.",
    )
    experiment: str = Field("mtprun", description="MLflow experiment name.")
    flush_timeout_s: float = Field(
        30.0,
        ge=0,
        description="At the end of a run, the longest wait (seconds) for the tracking backlog "
        "to upload; what is left stays in <run_dir>/tracking/ for `mtprun sync` or `mtprun "
        "resume`.",
    )
    spool_limit_mib: int = Field(
        1024,
        ge=1,
        description="Bound of the tracking backlog spooled in <run_dir>/tracking/ while the "
        "tracking server is unreachable; past it new records are dropped (run status never).",
    )
