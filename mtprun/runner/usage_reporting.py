"""mtprun runs offline: none of the libraries it drives reports usage over the network unless
the user asks for it (an explicit setting of any of these variables wins). On a cluster
without egress each library's reporting thread would retry its posts in the background, and
a training run would send third-party usage data its user never opted into."""

from __future__ import annotations

import os

USAGE_REPORTING_OFF = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow's client and server (MLflow >= 3.2)
    "VLLM_NO_USAGE_STATS": "1",  # vLLM's report at each GPU engine start
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray's cluster report from a local instance
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def disable_usage_reporting() -> None:
    """Set this process's (and its children's) reporting switches off where unset."""
    for name, value in USAGE_REPORTING_OFF.items():
        os.environ.setdefault(name, value)
