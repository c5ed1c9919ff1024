"""Episodes scored by the recipe's reward (`task.reward`, or the weighted `task.rewards`),
in parallel, each call under `task.reward_timeout_s`: reward functions in worker processes,
an endpoint judge in a pool of threads (`concurrency` requests in flight), a reward model the
run serves (a classifier or a judge, mtprun.runner.rollout.scorers) in one batched call per
step to its engine, shared by every reward that serves the same model folder and kind.

The workers are spawned processes that import the reward once (a user file included) and
then score one episode per message. A dispatcher thread hands queued episodes to idle
workers, collects their results into futures, and kills a worker whose call outlives the
timeout (a fresh one replaces it): a hanging or crashing reward never blocks the run.

A call that raises, times out, kills its process or returns a non-finite value is an
error: counted in `reward/errors` and scored `task.reward_on_error`, or, with `fail`,
stopping the run with the prompt, the completion and the traceback. An episode whose
environment gave its reward is not scored again (a non-finite one is an error too).

With `task.rewards` every reward scores every episode; the episode's reward is their weighted
sum, each logged as `reward/<name>` (a function's own components as `reward/<name>/<component>`).
A reward that fails scores `reward_on_error` in the sum, and the episode counts in
`reward/errors` (under `fail` the run stops).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import multiprocessing
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from mtprun.data.messages import Conversation, Prompt
from mtprun.data.rewards import RewardInput, RewardValueError
from mtprun.data.rewards.endpoint import JudgeError
from mtprun.runner.rollout.reward_outcome import RewardOutcome
from mtprun.runner.rollout.reward_worker import BROKEN, READY, worker_main
from mtprun.runner.rollout.scorers import ScorerPlacement, ServedScorer, ServedTerm
from mtprun.sources.scoring import InThreads, InWorkers, OnActor, Scoring
from mtprun.spec.actors import served_engine_key
from mtprun.spec.sources import reward_source

log = logging.getLogger("mtprun")
_CONTEXT = multiprocessing.get_context("spawn")  # the driver holds threads and Ray: no fork


class RewardFailed(RuntimeError):
    """A reward call failed under `task.reward_on_error: fail`."""


@dataclass
class Scores:
    """The rewards of a batch of episodes: totals (errors scored `on_error`) and outcomes."""

    totals: list[float]
    outcomes: list[RewardOutcome]

    @property
    def errors(self) -> int:
        return sum(o.error is not None for o in self.outcomes)


def component_means(outcomes: Sequence[RewardOutcome]) -> dict[str, float]:
    """`reward/<name>`: the mean of every named component over the outcomes that returned it
    (`total` is `reward/mean`, logged by the caller)."""
    values: dict[str, list[float]] = {}
    for outcome in outcomes:
        for name, value in (outcome.components or {}).items():
            if name != "total":
                values.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in values.items()}


@dataclass(frozen=True)
class _Term:
    """One reward of the scorer: its metric name, weight, and how it scores an episode (a
    future outcome); None: a served model's, whose engine scores a whole batch at once."""

    name: str
    weight: float
    submit: Callable[[RewardInput], Future[RewardOutcome]] | None = None


class EpisodeScorer:
    """The recipe's reward over episodes: reward workers and judges plus the
    `reward_on_error` policy.

    `reward`: one reward (a reward source's config: a built-in's name, a function reference,
    an endpoint judge, a served reward model...), the entries of task.rewards (objects with
    `label`, `weight` and `spec`), or None. Each reward runs the way its source's scoring plan
    says (mtprun.sources.scoring). An episode whose environment gave a reward keeps it
    (unscored); without a reward (an environment meant to reward every episode) one it did not
    reward is an error.
    Served reward models start here, as Ray actors placed by `placement`: one per model
    folder and kind, shared by the rewards that serve it. With `wait` False they load in the
    background until `wait_started` (the run's driver starts its rollout engines meanwhile).
    """

    def __init__(
        self,
        reward: Any,
        workers: int,
        timeout_s: float,
        on_error: float | str,
        placement: ScorerPlacement | None = None,
        wait: bool = True,
    ) -> None:
        self.on_error = on_error
        self.combined = isinstance(reward, list | tuple)
        if isinstance(reward, list | tuple):
            specs = [(term.label, float(term.weight), term.spec) for term in reward]
            self.reward = "task.rewards (" + ", ".join(name for name, _, _ in specs) + ")"
        elif reward is None:
            specs, self.reward = [], "of task.environment"  # in messages
        else:
            specs = [("total", 1.0, reward)]
            self.reward = reward_source(reward).describe(reward)
        plans = [(name, weight, reward_source(spec).scoring(spec)) for name, weight, spec in specs]
        references = list(
            dict.fromkeys(p.reference for _, _, p in plans if isinstance(p, InWorkers))
        )
        self.pool = RewardPool(references, workers, timeout_s) if references else None
        self.judges: list[JudgePool] = []
        self.served: dict[tuple[str, str], ServedScorer] = {}  # by served_engine_key
        self._terms: list[_Term] = []
        for name, weight, plan in plans:
            self._terms.append(self._term(name, weight, plan, references, placement, timeout_s))
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Returns once every served reward model has loaded; when one failed to, closes the
        scorer and raises that model's RuntimeError."""
        try:
            for served in self.served.values():
                served.wait_started()
        except BaseException:
            self.close()  # the reward workers and the other served models
            raise

    def _term(
        self,
        name: str,
        weight: float,
        plan: Scoring,
        references: list[str],
        placement: ScorerPlacement | None,
        timeout_s: float,
    ) -> _Term:
        """One reward's term, run the way its source's scoring plan says."""
        if isinstance(plan, InWorkers):
            assert self.pool is not None
            submit = functools.partial(self.pool.submit, which=references.index(plan.reference))
            return _Term(name, weight, submit=submit)
        if isinstance(plan, OnActor):
            if placement is None:
                raise ValueError(f"the {plan.label} needs a placement to run on")
            key = served_engine_key(plan.spec)
            if key not in self.served:
                self.served[key] = ServedScorer(plan.spec, placement, timeout_s)
            where = f"reward {name}" if self.combined else "task.reward"
            # The term's index in self._terms: the one being built.
            self.served[key].add(len(self._terms), ServedTerm.of(where, plan.spec))
            return _Term(name, weight)
        judge = JudgePool(plan, timeout_s)
        self.judges.append(judge)
        return _Term(name, weight, submit=judge.submit)

    @classmethod
    def for_task(
        cls, task: Any, placement: ScorerPlacement | None = None, wait: bool = True
    ) -> EpisodeScorer:
        """The scorer of `task`; `placement`: where its served reward models run."""
        reward = task.rewards if task.rewards is not None else task.effective_reward
        return cls(
            reward,
            task.reward_workers,
            task.reward_timeout_s,
            task.reward_on_error,
            placement,
            wait,
        )

    def score(
        self,
        prompts: Sequence[Prompt],
        conversations: Sequence[Conversation],
        given: Sequence[float | None] | None = None,
        raw_completions: Sequence[str | None] | None = None,
        given_components: Sequence[dict[str, float] | None] | None = None,
    ) -> Scores:
        """Rewards of episode k = (prompts[k], conversations[k]): `given[k]` when it is a
        number (the reward its environment gave), else the reward's, which gets
        `raw_completions[k]` (the text of the episode's final turn as generated; None:
        rebuilt from its final message; `given_components[k]`: the named parts of `given[k]`).
        Raises RewardFailed on the first error under `reward_on_error: fail`."""
        raws = list(raw_completions) if raw_completions is not None else [None] * len(prompts)
        inputs = [
            RewardInput.of(p, c, raw)
            for p, c, raw in zip(prompts, conversations, raws, strict=True)
        ]
        given = list(given) if given is not None else [None] * len(inputs)
        unscored = [k for k, reward in enumerate(given) if reward is None]
        # A served engine scores the whole batch for its terms in one call; the others score
        # episode by episode.
        batches: dict[int, list[Future[RewardOutcome]]] = {}
        for served in self.served.values():
            batches.update(served.submit_many([inputs[k] for k in unscored]))
        parts = list(given_components or [None] * len(given))
        futures = [_given(reward, part) for reward, part in zip(given, parts, strict=True)]
        for j, k in enumerate(unscored):
            futures[k] = self._submitted(
                [
                    batches[i][j] if term.submit is None else term.submit(inputs[k])
                    for i, term in enumerate(self._terms)
                ]
            )
        outcomes = [
            self._combine([f.result() for f in fs]) if isinstance(fs, list) else fs.result()
            for fs in futures
        ]
        totals = []
        for k, (episode, outcome) in enumerate(zip(inputs, outcomes, strict=True)):
            if outcome.error is not None and self.on_error == "fail":
                raise RewardFailed(self._failure(k, episode, outcome.error))
            if outcome.components is not None:
                totals.append(outcome.components["total"])
            else:
                totals.append(float(self.on_error))
        if any(o.error for o in outcomes):
            first = next(o.error for o in outcomes if o.error)
            log.warning(
                "reward %s failed on %d of %d episode(s), scored %s (task.reward_on_error); "
                "first error: %s",
                self.reward,
                sum(o.error is not None for o in outcomes),
                len(outcomes),
                self.on_error,
                first.strip().splitlines()[-1],
            )
        return Scores(totals, outcomes)

    def _submitted(
        self, futures: list[Future[RewardOutcome]]
    ) -> Future[RewardOutcome] | list[Future[RewardOutcome]]:
        """An episode's future outcome of the one reward, or of each of task.rewards (a
        list), from its futures of every term."""
        if self.combined:
            return futures
        if futures:
            return futures[0]
        return _done(
            RewardOutcome(
                None,
                "the environment gave this episode no reward, and the recipe has no "
                "task.reward to score it",
            )
        )

    def _combine(self, results: list[RewardOutcome]) -> RewardOutcome:
        """The weighted sum of task.rewards' outcomes on one episode."""
        components: dict[str, float] = {}
        errors: list[str] = []
        total = 0.0
        for term, outcome in zip(self._terms, results, strict=True):
            if outcome.components is None:
                errors.append(f"reward {term.name}: {outcome.error}")
                value = 0.0 if self.on_error == "fail" else float(self.on_error)
            else:
                value = outcome.components["total"]
                components[term.name] = value
                for part, number in outcome.components.items():
                    if part != "total":
                        components[f"{term.name}/{part}"] = number
            total += term.weight * value
        if errors and self.on_error == "fail":
            return RewardOutcome(None, "\n".join(errors))
        return RewardOutcome({**components, "total": total}, "\n".join(errors) or None)

    def _failure(self, k: int, episode: RewardInput, error: str) -> str:
        prompt = "\n".join(f"  {m['role']}: {m['content']}" for m in episode.messages[:-1])
        return (
            f"reward {self.reward} failed on episode {k} (task.reward_on_error: fail)\n"
            f"prompt record: {_short(repr(episode.prompt))}\n"
            f"conversation before the completion:\n{_short(prompt)}\n"
            f"completion: {episode.completion!r}\n"
            f"as generated: {_short(repr(episode.raw_completion))}\n{error.rstrip()}"
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for closing in (*self.judges, *self.served.values()):
            closing.close()


class JudgePool:
    """A judge scoring episodes in `concurrency` threads (an endpoint judge: its source's
    InThreads plan); `submit` returns a future outcome. Each call has task.reward_timeout_s
    from when it starts (its retries included): a call still running then is answered as timed
    out (its thread is left to finish)."""

    def __init__(self, plan: InThreads, timeout_s: float) -> None:
        self.judge = plan.make()
        self.label = plan.label
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(plan.concurrency, thread_name_prefix="mtprun-judge")

    def submit(self, episode: RewardInput) -> Future[RewardOutcome]:
        outcome: Future[RewardOutcome] = Future()
        try:
            self._executor.submit(self._call, episode, outcome)
        except RuntimeError as err:  # shut down
            _settle(outcome, RewardOutcome(None, f"{self.label}: {err}"))
        return outcome

    def _call(self, episode: RewardInput, outcome: Future[RewardOutcome]) -> None:
        deadline = time.monotonic() + self.timeout_s
        timed_out = RewardOutcome(None, self._timed_out(""))
        # A backstop for a server that trickles its answer (each read has its own timeout).
        watchdog = threading.Timer(self.timeout_s + 1.0, _settle, (outcome, timed_out))
        watchdog.daemon = True
        watchdog.start()
        try:
            result = RewardOutcome(self.judge.score(episode, deadline))
        except (JudgeError, TimeoutError) as err:
            late = time.monotonic() >= deadline
            error = self._timed_out(str(err)) if late else f"{self.label}: {err}"
            result = RewardOutcome(None, error)
        except RewardValueError as err:
            result = RewardOutcome(None, f"{self.label}: {err}")
        except BaseException:
            result = RewardOutcome(None, traceback.format_exc())
        finally:
            watchdog.cancel()
        _settle(outcome, result)

    def _timed_out(self, detail: str) -> str:
        message = (
            f"timed out: the {self.label} took longer than {self.timeout_s:g} s "
            "(task.reward_timeout_s)"
        )
        return f"{message}: {detail}" if detail else message

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _settle(future: Future[RewardOutcome], outcome: RewardOutcome) -> None:
    """Set `future`'s outcome unless it has one (the call and its watchdog race)."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(outcome)


def _given(
    reward: float | None, components: dict[str, float] | None = None
) -> Future[RewardOutcome]:
    """The outcome of an environment's reward with its named parts (a non-finite one is an
    error; None: a placeholder for an episode the rewards score)."""
    if reward is None:
        return Future()
    if math.isfinite(reward):
        return _done(RewardOutcome({**(components or {}), "total": float(reward)}))
    return _done(RewardOutcome(None, f"the environment's reward is {reward} (not finite)"))


def _done(outcome: RewardOutcome) -> Future[RewardOutcome]:
    future: Future[RewardOutcome] = Future()
    future.set_result(outcome)
    return future


@dataclass
class _Job:
    episode: RewardInput
    future: Future[RewardOutcome]
    which: int = 0  # the index of the reward that scores it
    deadline: float = math.inf


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    job: _Job | None = None
    started: float = field(default_factory=time.monotonic)


class RewardPool:
    """`workers` processes running reward `reference` (or each of several references, chosen
    per episode by `submit`'s `which`); `submit` returns a future outcome.

    A worker that cannot load the reward (validated recipes rarely get here) fails every
    episode with the import error instead of being started again and again.
    """

    def __init__(self, reference: str | Sequence[str], workers: int, timeout_s: float) -> None:
        self.references = [reference] if isinstance(reference, str) else list(reference)
        self.reference = ", ".join(self.references)
        self.timeout_s = timeout_s
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._wake_read, self._wake_write = _CONTEXT.Pipe(duplex=False)
        self._closing = False
        self._broken: str | None = None
        self._workers = [self._spawn() for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self._thread = threading.Thread(target=self._dispatch, name="reward-pool", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def submit(self, episode: RewardInput, which: int = 0) -> Future[RewardOutcome]:
        """The future outcome of reward `which` (an index of the references) on `episode`."""
        job = _Job(episode, Future(), which)
        with self._lock:
            if self._closing:
                raise RuntimeError("the reward pool is closed")
            if not self._thread.is_alive():  # crashed: nothing would ever score it
                job.future.set_result(
                    RewardOutcome(None, self._broken or "the reward pool stopped")
                )
                return job.future
            self._queue.append(job)
        self._wake_write.send_bytes(b"")
        return job.future

    def close(self) -> None:
        """Stop the workers (a call still running is abandoned) and the dispatcher."""
        with self._lock:
            self._closing = True
        self._wake_write.send_bytes(b"")
        self._thread.join(timeout=30)
        self._finalizer()

    # ---- the dispatcher thread -----------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = _CONTEXT.Pipe()
        process = _CONTEXT.Process(
            target=worker_main,
            args=(child, self.references),
            name="mtprun-reward",
            daemon=False,
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    def _dispatch(self) -> None:
        try:
            while not self._closing:
                self._hand_out()
                busy = [w.job.deadline for w in self._workers if w.job is not None]
                timeout = max(0.0, min(busy) - time.monotonic()) if busy else None
                readable = wait([self._wake_read, *(w.conn for w in self._workers)], timeout)
                for conn in readable:
                    if conn is self._wake_read:
                        self._wake_read.recv_bytes()
                    else:
                        self._receive(next(w for w in self._workers if w.conn is conn))
                self._expire()
        except BaseException:  # never leave a caller waiting on a future
            self._broken = "reward dispatcher crashed:\n" + traceback.format_exc()
            log.error("%s", self._broken)
            self._fail_all(self._broken)
        finally:
            self._fail_all("the reward pool was closed before this episode was scored")

    def _hand_out(self) -> None:
        with self._lock:
            if self._broken is not None:
                while self._queue:
                    self._queue.popleft().future.set_result(RewardOutcome(None, self._broken))
                return
            for worker in self._workers:
                if not self._queue:
                    return
                if worker.ready and worker.job is None:
                    job = self._queue.popleft()
                    job.deadline = time.monotonic() + self.timeout_s
                    worker.job = job
                    try:
                        worker.conn.send((job.which, job.episode))
                    except OSError:  # it died since its last message: retry the episode
                        worker.job = None
                        self._queue.appendleft(job)
                        self._replace(worker, "")

    def _receive(self, worker: _Worker) -> None:
        try:
            kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            died = f"the reward's process died (exit code {worker.process.exitcode})"
            if not worker.ready:  # before loading the reward: a fresh one would die the same way
                self._broken = f"{died} while starting, before it loaded {self.reference}"
                log.error("%s", self._broken)
            self._replace(worker, self._broken or died)
            return
        if kind == READY:
            worker.ready = True
        elif kind == BROKEN:
            self._broken = f"the reward {self.reference} could not be loaded:\n{payload}"
            log.error("%s", self._broken)
            self._finish(worker, RewardOutcome(None, self._broken))
        else:
            self._finish(worker, RewardOutcome(*payload))

    def _expire(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.job is not None and now >= worker.job.deadline:
                self._replace(
                    worker,
                    f"timed out: the reward took longer than {self.timeout_s:g} s "
                    "(task.reward_timeout_s); its process was killed",
                )

    def _replace(self, worker: _Worker, error: str) -> None:
        """Kill `worker`, fail its episode with `error`, start a fresh worker."""
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        self._finish(worker, RewardOutcome(None, error))
        if self._broken is None:
            self._workers[self._workers.index(worker)] = self._spawn()
        else:  # it cannot load the reward: a fresh one would not either
            self._workers.remove(worker)

    def _finish(self, worker: _Worker, outcome: RewardOutcome) -> None:
        job, worker.job = worker.job, None
        if job is not None:
            job.future.set_result(outcome)

    def _fail_all(self, error: str) -> None:
        with self._lock:
            jobs = [w.job for w in self._workers if w.job is not None] + list(self._queue)
            self._queue.clear()
            for worker in self._workers:
                worker.job = None
        for job in jobs:
            if not job.future.done():
                job.future.set_result(RewardOutcome(None, error))


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=10)


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
