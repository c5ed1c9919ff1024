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
