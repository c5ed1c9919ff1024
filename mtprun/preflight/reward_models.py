"""The reward models a run serves (`task.reward: {model: <HF folder>, kind: ...}`), read from
their folders before the run: what is wrong with one (reported at the recipe value), and what
it costs (its actor's CPUs and GPUs, its weights' memory from config.json).

Weights' memory = parameters x bytes of the config's dtype (2 for bfloat16/float16, 4 for
float32). Parameters are the decoder's (`mtprun.preflight.memory.parameters`) with the output
layer of a classifier replaced by its score head (num_labels x hidden). vLLM adds its KV cache
on top: `VLLM_CPU_KVCACHE_SPACE` GiB on CPU, the engine's share of `gpu_memory_utilization` on
a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtprun.data.rewards.endpoint import parse_problem, template_problem
from mtprun.models.shape import ModelShape
from mtprun.preflight.memory import parameters
from mtprun.spec.actors import served_rewards
from mtprun.spec.document import KeyPath
from mtprun.spec.rewards import ServedReward, is_parse_function
from mtprun.spec.sections import RecipeSections

CLASSIFIER_SUFFIX = "ForSequenceClassification"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ServedModel:
    """One served reward model as its folder describes it."""

    where: KeyPath
    spec: ServedReward
    architecture: str
    parameters: int
    dtype: str
    cpus: float
    gpus: float

    @property
    def weight_bytes(self) -> int:
        return self.parameters * _DTYPE_BYTES.get(self.dtype, 4)

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": ".".join(map(str, self.where)),
            "kind": self.spec.kind,
            "model": self.spec.model,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "dtype": self.dtype,
            "weight_bytes": self.weight_bytes,
            "cpus": self.cpus,
            "gpus": self.gpus,
        }


def _config(spec: ServedReward) -> tuple[dict[str, Any] | None, str | None]:
    """The folder's config.json, or why there is none."""
    folder = Path(spec.model)
    if not folder.is_dir():
        return None, f"reward model folder not found: {folder}"
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except OSError:
        return None, f"{path}: no config.json; is {folder} an HF model folder?"
    except ValueError as err:
        return None, f"{path} is not JSON: {err}"


def _labels(config: dict[str, Any]) -> int:
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def served_model_problems(spec: ServedReward) -> list[tuple[str, str]]:
    """(field, message) for each thing wrong with a served reward model: its folder, its
    config's architecture and labels, a judge's template and parse function."""
    problems: list[tuple[str, str]] = []
    config, problem = _config(spec)
    if problem is not None:
        problems.append(("model", problem))
    elif config is not None:
        archs = config.get("architectures") or []
        classifier = any(a.endswith(CLASSIFIER_SUFFIX) for a in archs)
        path = Path(spec.model) / "config.json"
        if spec.kind == "classifier" and not classifier:
            problems.append(
                (
                    "model",
                    f"{path}: architectures {archs} is not a *{CLASSIFIER_SUFFIX} checkpoint: a "
                    "classifier reward model scores with a sequence-classification head (for a "
                    "causal LM that writes its verdict, use kind: judge)",
                )
            )
        elif spec.kind == "judge" and classifier:
            problems.append(
                (
                    "kind",
                    f"{path}: architectures {archs} is a sequence classifier, which writes no "
                    "text: use kind: classifier",
                )
            )
        elif spec.kind == "classifier":
            labels = _labels(config)
            if spec.score_label is None and labels != 1:
                problems.append(
                    (
                        "model",
                        f"{path}: the classifier has {labels} labels; set score_label to the "
                        "label whose logit is the reward",
                    )
                )
            elif spec.score_label is not None and spec.score_label >= labels:
                problems.append(
                    (
                        "score_label",
                        f"score_label {spec.score_label} but {path} has {labels} labels "
                        f"(0 to {labels - 1})",
                    )
                )
        if not _has_chat_template(Path(spec.model)):
            problems.append(
                ("model", f"{spec.model} has no chat template to render the conversation with")
            )
    if spec.kind == "judge":
        assert spec.prompt is not None  # the spec requires it
        problem = template_problem(spec.prompt)
        if problem is not None:
            problems.append(("prompt", problem))
        if is_parse_function(spec.parse) and (problem := parse_problem(spec.parse)):
            problems.append(("parse", problem))
    return problems


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def served_models(recipe: RecipeSections) -> list[ServedModel]:
    """The recipe's served reward models whose folders are readable here."""
    res = recipe.resources
    models = []
    for where, spec in served_rewards(recipe):
        config, problem = _config(spec)
        shape = ModelShape.read(spec.model)
        if config is None or problem is not None or shape is None:
            continue
        archs = config.get("architectures") or ["?"]
        count = parameters(shape)
        if spec.kind == "classifier":  # its score head in place of an output layer
            untied_output = 0 if shape.tie_embeddings else shape.vocab * shape.hidden
            count += _labels(config) * shape.hidden - untied_output
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        models.append(
            ServedModel(where, spec, archs[0], count, dtype, res.cpus_per_actor, res.gpus_per_actor)
        )
    return models
