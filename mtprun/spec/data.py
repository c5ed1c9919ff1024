"""`data:` (SFT), `task:` (RL), `warmstart:` (an SFT stage before RL) and the datasets they read."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)

from mtprun.spec.base import Section
from mtprun.spec.rewards import RewardSpec, RewardTerm
from mtprun.spec.sources import (
    PROMPT_SOURCES,
    TASK_SOURCES,
    PromptSpec,
    infer_task_type,
    task_source,
)

Template = Literal["char", "chatml", "glm"]
DATA_FILE_SUFFIXES: tuple[str, ...] = PROMPT_SOURCES["dataset"].SUFFIXES
"""Files a dataset path may name (or a folder may hold); see mtprun/data/dataset_files.py."""
SEARCH_TASK = "search"
"""The built-in Search-R1 task's name (task.name: search, with task.search and task.prompts)."""
VERIFIERS_ENVIRONMENT = "verifiers:"
"""A task.environment naming a verifiers taskset starts so (see data/tasks/verifiers_env.py)."""
TaskType = Literal[TASK_SOURCES.names()]  # type: ignore[valid-type]


DatasetSpec = PROMPT_SOURCES["dataset"].CONFIG
"""A local dataset {path, columns, shuffle, heldout} (mtprun/sources/prompts/dataset.py)."""
ColumnMap = DatasetSpec.model_fields["columns"].annotation
ReasoningGymSpec = PROMPT_SOURCES["reasoning_gym"].CONFIG
"""A reasoning-gym dataset {reasoning_gym, size, seed, config}
(mtprun/sources/prompts/reasoning_gym.py)."""

PromptSource = PromptSpec
"""Prompts: one prompt source's config, `type:`-tagged (inferred when unset): a local dataset
{path, columns, shuffle, heldout} or a reasoning-gym dataset {reasoning_gym, size, seed,
config}."""


RENDERER_DESCRIPTION = (
    "How an HF model folder's conversations become tokens: `auto` (the `renderers` library's "
    "renderer of the folder's model family, from its config.json, when it reproduces the "
    "folder's chat template; else mtprun's own attribution), a `renderers` family name "
    "(qwen3, glm-4.5, deepseek-v3, llama-3, ...), a table {name: <family>, <option>: <value>} "
    "such as {name: qwen3, enable_thinking: false}, or `none` (mtprun's own attribution of "
    "the folder's chat template). Tiny models render with `template`."
)


def check_renderer(value: Any) -> Any:
    """A `renderer:` setting names `auto`, `none` or a `renderers` family, with that family's
    options only (a field validator; the library's own configs say what each family takes)."""
    from pydantic import ValidationError
    from renderers.configs import _CONFIG_BY_NAME  # the library's family -> config map

    # `default` is the library's opaque apply_chat_template renderer, with no sampled mask:
    # mtprun's own attribution (`none`) is what labels such a template.
    families = sorted(set(_CONFIG_BY_NAME) - {"auto", "default"})
    if isinstance(value, str) and value in ("auto", "none"):
        return value
    options = {"name": value} if isinstance(value, str) else value
    if not isinstance(options, dict) or not isinstance(options.get("name"), str):
        raise ValueError(
            "renderer must be `auto`, `none`, a family name or a table {name: <family>, ...}"
        )
    name = options["name"]
    if name not in families:
        raise ValueError(f"unknown renderer {name!r}; known: auto, none, {', '.join(families)}")
    try:
        _CONFIG_BY_NAME[name](**{k: v for k, v in options.items() if k != "name"})
    except ValidationError as err:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"renderer {name!r}: {details}") from None
    return value


class OverlongBuffer(Section):
    """DAPO's over-long reward shaping: a soft penalty on responses close to the length cap.

    With L = rollout.max_tokens, B = `tokens` and P = `penalty`, a response of n sampled
    tokens (a multi-turn episode: all its sampled tokens) gets

        0                        when n <= L - B
        -P * (n - (L - B)) / B   when L - B < n <= L
        -P                       when it was cut at L (truncated)

    added to the task's reward and logged as reward/overlong.
    """

    tokens: int = Field(
        ...,
        ge=1,
        description="B: the last B tokens below rollout.max_tokens, over which the penalty "
        "grows linearly from 0 to `penalty` (must be below rollout.max_tokens).",
    )
    penalty: float = Field(
        1.0,
        gt=0,
        description="P: the penalty at rollout.max_tokens and of a response cut there.",
    )

    def shaping(self, length: int, max_tokens: int, truncated: bool) -> float:
        """The reward added to a response of `length` sampled tokens (`truncated`: cut at
        `max_tokens`)."""
        if truncated:
            return -self.penalty
        start = max_tokens - self.tokens
        if length <= start:
            return 0.0
        return -self.penalty * min(length - start, self.tokens) / self.tokens


class SearchSpec(Section):
    """Search-R1's environment: the model searches a corpus between its turns."""

    corpus: str | None = Field(
        None,
        description="A .jsonl or .parquet file of passages {id, text, title?} (relative to the "
        "recipe file that sets it), searched with BM25 (its index built once per run and "
        "cached in the run folder). null: `endpoint` answers the searches.",
    )
    endpoint: str | None = Field(
        None,
        description="Your own retrieval server in place of `corpus`: mtprun POSTs "
        '{"queries": [q], "topk": top_k, "return_scores": true} to this URL (Search-R1\'s '
        'retrieval server API) and reads {"result": [[{"document": {"contents"}} ...]]}; '
        "failed calls are retried with backoff and counted in search/errors.",
    )
    top_k: int = Field(3, ge=1, description="Passages returned per search.")
    max_turns: int = Field(
        4,
        ge=1,
        description="Assistant turns per episode: the episode ends at <answer>...</answer> or "
        "after this many turns (task.max_turns is not used by the search task).",
    )
    retries: int = Field(
        2,
        ge=0,
        description="With `endpoint`: retries of a request that failed to connect, timed out "
        "or got a 429 or 5xx answer (backing off).",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="With `endpoint`: seconds one search may take, retries included."
    )

    @field_validator("endpoint")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {value!r} is not an http:// or https:// URL")
        return value

    @model_validator(mode="after")
    def _one_retriever(self) -> SearchSpec:
        if (self.corpus is None) == (self.endpoint is None):
            raise ValueError(
                "search needs `corpus:` (a passage file searched with BM25) or `endpoint:` "
                "(your retrieval server), "
                + ("not both" if self.corpus is not None else "and has neither")
            )
        if self.corpus is not None and not self.corpus.endswith((".jsonl", ".parquet")):
            raise ValueError(f"corpus {self.corpus!r} is not a .jsonl or .parquet file")
        return self


def path_shorthand(value: Any) -> Any:
    """`prompts: file.parquet` is `prompts: {path: file.parquet}` (a field validator)."""
    return {"path": value} if isinstance(value, str) else value


class DataSection(Section):
    """Supervised fine-tuning data."""

    source: str | DatasetSpec = Field(
        ...,
        description="A built-in synthetic task such as `arithmetic`, or a dataset of "
        "conversations: a file or folder (relative to the recipe file that sets it), or "
        "{path, columns, shuffle} (a `prompt` and `answer` column make a user/assistant pair).",
    )
    template: Template = Field(
        "char",
        description="Chat template: char (the tiny character-level one), chatml (Qwen style) "
        "or glm (GLM style, the stop token is the next message's opening tag).",
    )
    renderer: str | dict[str, Any] = Field("auto", description=RENDERER_DESCRIPTION)
    _renderer = field_validator("renderer")(check_renderer)

    packing_length: int = Field(
        512, ge=1, description="Tokens per packed row; conversations are packed back to back."
    )
    num_samples: int = Field(
        2048, ge=1, description="Examples drawn from a synthetic source (ignored for files)."
    )


class TaskSection(Section):
    """Reinforcement learning: prompts, a verifiable reward and the sampling shape."""

    type: TaskType | None = Field(
        None,
        description="The task's source (mtprun/sources/tasks/): builtin (task.name, a built-in "
        "task), prompts (task.prompts), verifiers (task.environment: verifiers:...) or search "
        "(task.search). Unset: inferred from the fields that are set.",
    )
    name: str | None = Field(
        None,
        description="A built-in synthetic task (arithmetic, calculator_tool), or a `.jsonl` "
        "file of prompts; a recipe sets `name` or `prompts`. `search` (Search-R1) is the "
        "one set with both: its `prompts` are {question, answers} rows and `search:` its "
        "retrieval.",
    )
    prompts: PromptSource | None = Field(
        None,
        description="A dataset of prompts (a path, or {path, columns, shuffle, heldout}), or a "
        "reasoning-gym dataset {reasoning_gym: <name>, size, seed, config}; a recipe sets "
        "`name` or `prompts`.",
    )
    reward: RewardSpec | None = Field(
        None,
        description="A built-in reward (exact_answer, math, reasoning_gym, ...) or a Python "
        "function: `package.module:function` or `path/to/file.py:function` (relative to the "
        "recipe file); it takes any of prompt, completion, messages, answer and returns a "
        "float or a mapping of named components with a `total`. Or an LLM judge behind an "
        "OpenAI-compatible endpoint: {url, model, prompt: <template file>, parse: <regex>}, or "
        "a reward model the run serves: {model: <HF folder>, kind: classifier} or {model, "
        "kind: judge, prompt, parse}. "
        "It scores the episodes the environment gives no reward. null: reasoning-gym prompts "
        "are scored by their dataset (reasoning_gym); otherwise only with task.rewards or a "
        "task.environment that rewards every episode (one it leaves unrewarded counts in "
        "reward/errors).",
    )
    rewards: list[RewardTerm] | None = Field(
        None,
        min_length=1,
        description="Several rewards combined by weight, in place of `reward`: each "
        "{reward: <name or function>, weight, name}, an endpoint judge {url, model, prompt, "
        "parse, ..., weight, name} or a served reward model {model, kind, ..., weight, name}; "
        "the episode's reward is the weighted sum, each one logged "
        "as reward/<name>. A failed one scores reward_on_error in the sum (the episode counts "
        "in reward/errors).",
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="Seconds one reward call may take before it counts as an error."
    )
    reward_on_error: float | Literal["fail"] = Field(
        0.0,
        description="The reward of an episode whose reward function raised, timed out or "
        "returned a non-finite value; `fail` stops the run with the prompt, the completion "
        "and the traceback.",
    )
    reward_workers: int = Field(2, ge=1, description="Processes that score episodes in parallel.")
    template: Template = Field("char", description="Chat template used to render prompts.")
    renderer: str | dict[str, Any] = Field("auto", description=RENDERER_DESCRIPTION)
    samples_per_prompt: int = Field(8, ge=1, description="Rollouts per prompt (the GRPO group).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per optimizer step.")
    max_turns: int = Field(
        1,
        ge=1,
        description="Assistant turns per rollout; above 1 the environment answers "
        "between turns (multi-turn tool use).",
    )
    environment: str | None = Field(
        None,
        description="The environment of multi-turn episodes: a class named `package.module:Class` "
        "or `path/to/file.py:Class` (relative to the recipe file that sets it), with "
        "reset(prompt) -> messages and step(messages) -> EnvStep (mtprun.data.environment). "
        "Or `verifiers:<module>` / `verifiers:path/to/file.py`: a verifiers (>= 0.4) taskset, "
        "whose tasks are the prompts (no task.name / prompts) and whose @vf.reward functions "
        "score every episode, weighted (no task.reward / rewards); its tools answer the "
        "model's calls between turns. "
        "null: the task's own (calculator_tool runs its calculator; other tasks end after one "
        "turn).",
    )
    drop_uniform_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (their "
        "advantages are 0) and sample more prompts until prompts_per_step groups remain, in "
        "at most max_sampling_rounds rounds.",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="With drop_uniform_groups, the most rounds of sampling per step; a step "
        "still short of groups trains on those it kept (or, when none, on its first round).",
    )

    overlong_buffer: OverlongBuffer | None = Field(
        None,
        description="DAPO's over-long reward shaping {tokens: B, penalty: P}: with L = "
        "rollout.max_tokens, a response of n sampled tokens gets 0 when n <= L - B, "
        "-P (n - (L - B)) / B when L - B < n <= L, -P when it was cut at L; added to the "
        "reward, logged as reward/overlong. null: no shaping.",
    )
    search: SearchSpec | None = Field(
        None,
        description="The Search-R1 task's retrieval (with `name: search`): {corpus, top_k, "
        "max_turns} or {endpoint, top_k, max_turns}. The model writes <search>query</search>, "
        "the environment answers <information>...</information> (a tool turn, never trained), "
        "the episode ends at <answer>...</answer>; reward: exact match against any of the "
        "row's answers (normalised), logged as reward/exact_match.",
    )

    _prompts_path = field_validator("prompts", mode="before")(path_shorthand)
    _renderer = field_validator("renderer")(check_renderer)
    _type_inferred: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _infer_type(cls, data: Any, handler: ModelWrapValidatorHandler[TaskSection]) -> TaskSection:
        """An untagged task's `type`: the first task source that claims its fields."""
        inferred = isinstance(data, dict) and "type" not in data
        if inferred:
            data = {**data, "type": infer_task_type(data)}
        task = handler(data)
        if inferred:
            task._type_inferred = True
        return task

    @property
    def type_inferred(self) -> bool:
        """Whether `type` was inferred from the other fields (the recipe sets none)."""
        return self._type_inferred

    @field_validator("environment")
    @classmethod
    def _verifiers_target(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(VERIFIERS_ENVIRONMENT):
            target = value.removeprefix(VERIFIERS_ENVIRONMENT)
            if not target.strip() or ":" in target:
                raise ValueError(
                    f"{value!r}: write verifiers:<module> (an importable taskset module or "
                    "package) or verifiers:path/to/file.py (relative to the recipe)"
                )
        return value

    @property
    def verifiers_environment(self) -> bool:
        """Whether task.environment names a verifiers taskset (`verifiers:<module>`)."""
        return (self.environment or "").startswith(VERIFIERS_ENVIRONMENT)

    @property
    def episode_turns(self) -> int:
        """Assistant turns per episode: task.search.max_turns for the search task, else
        task.max_turns."""
        return self.search.max_turns if self.search is not None else self.max_turns

    @property
    def effective_reward(self) -> Any:
        """The one reward that scores episodes: task.reward, or for reasoning-gym prompts
        their dataset's scorer; None with task.rewards (or an environment's rewards only)."""
        if self.reward is None and self.rewards is None and self.type is not None:
            return task_source(self).default_reward(self)
        return self.reward

    @field_validator("reward_on_error")
    @classmethod
    def _finite(cls, value: float | str) -> float | str:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("reward_on_error must be a finite number or `fail`")
        return value


class WarmstartSection(Section):
    """An SFT stage run first, in the same run, before RL starts."""

    data: DataSection = Field(..., description="SFT data of the warm-start stage.")
    steps: int = Field(..., ge=1, description="Optimizer steps of the warm-start stage.")
    lr: float = Field(..., gt=0, description="Learning rate of the warm-start stage.")
