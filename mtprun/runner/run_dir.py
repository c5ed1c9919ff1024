"""The run folder: every file a run writes lives under one directory.

<run_dir>/
  recipe.yaml          the recipe as given (for people and MLflow)
  recipe.json          the validated recipe (what `mtprun resume` reloads)
  plan.json            the compiled HeadPlan
  state.json           run identity: MLflow tracking URI, experiment and run id
  log.txt              the full log of every attempt (appended on resume)
  .lock                held (flock) by the one process that owns the folder (run_lock.py)
  tracking/            the tracking spool: records not yet on the MLflow server (spool.py)
  mlflow.db            the default local MLflow store, artifacts under mlartifacts/
  model/               the initial HF model folder (built tiny model or a link to model.path)
  checkpoints/step_N/  trainer state + an HF export of the policy at step N
  export/              `mtprun export` output
  datasets/            Arrow copies of parquet/csv/jsonl datasets (unlinked once mapped) and
                       the SFT token counts a resume reads instead of rendering again
  ray/ vllm/           Ray's temp folder and vLLM's caches/sockets, so nothing lands in /tmp
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ray refuses Unix socket paths over 107 bytes and puts its sockets ~64 bytes deep under its
# temp folder (session_<date>_<time>_<usec>_<pid>/sockets/plasma_store).
_MAX_RAY_TEMP_LEN = 40


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).resolve())

    @property
    def recipe_yaml(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def recipe_json(self) -> Path:
        return self.root / "recipe.json"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def state_json(self) -> Path:
        return self.root / "state.json"

    @property
    def log_file(self) -> Path:
        return self.root / "log.txt"

    @property
    def tracking_spool(self) -> Path:
        return self.root / "tracking"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def exports(self) -> Path:
        return self.root / "export"

    @property
    def vllm_dir(self) -> Path:
        return self.root / "vllm"

    @property
    def default_tracking_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    @property
    def artifact_root(self) -> Path:
        return self.root / "mlartifacts"

    def ray_temp_dir(self) -> Path:
        """Ray's temp folder: inside the run folder unless that path is too long for Ray's
        Unix sockets, then a short per-run folder under the system temp dir."""
        inside = self.root / "ray"
        if len(str(inside)) <= _MAX_RAY_TEMP_LEN:
            return inside
        import hashlib
        import tempfile

        digest = hashlib.sha1(str(self.root).encode()).hexdigest()[:10]
        return Path(tempfile.gettempdir()) / f"mtprun-ray-{digest}"

    def create(self) -> RunDir:
        for folder in (self.root, self.checkpoints, self.vllm_dir):
            folder.mkdir(parents=True, exist_ok=True)
        return self

    def has_run(self) -> bool:
        return self.state_json.exists()

    def read_state(self) -> dict[str, Any]:
        if not self.state_json.exists():
            raise FileNotFoundError(
                f"{self.root} is not an mtprun run folder (no state.json); "
                "pass the folder a previous `mtprun run` created (its run_dir)"
            )
        return json.loads(self.state_json.read_text())

    def write_state(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.state_json, state)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that a reader (or a crash) never sees a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
