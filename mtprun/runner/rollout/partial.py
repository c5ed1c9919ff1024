"""Partial rollouts: generation in chunks, with weight updates allowed between chunks.

With asynchronous rollouts the weight sync of version v waits for the generation running
ahead to finish, so one long-tailed response holds it (and the trainer's next step). With
`rollout.partial` a turn's responses grow `partial_chunk_tokens` at a time: after each chunk
the generation calls `between_chunks` (the run's pause point, where a waiting sync runs), and
the responses not yet finished continue from their own tokens, re-read under whatever weights
the engines hold then (their KV cache is recomputed: the prefix cache was reset by the sync),
as slime's partial rollouts and AReaL's interruptible generation do. Each token keeps the
version that sampled it (`Sample.token_versions`), the first chunk's being the oldest.

A response is unfinished when a chunk ended it at the chunk's length ("length") before the
turn's `max_tokens`: every such response has the same length after each chunk, so one call
continues them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from mtprun.runner.rollout.engine import Sample, Sampling

Generate = Callable[[list[list[int]], int, Sampling], list[list[Sample]]]


class PartialRollouts:
    def __init__(self, chunk_tokens: int, max_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.max_tokens = max_tokens  # the rollout section's, where a sampling leaves it None
        self.between_chunks: Callable[[], None] = lambda: None  # the run sets its pause point

    def generate(
        self, generate: Generate, prompts: list[list[int]], n: int, sampling: Sampling
    ) -> list[list[Sample]]:
        """`generate(prompts, n, sampling)` as if in one call, in chunks (module docstring)."""
        limit = sampling.max_tokens or self.max_tokens
        chunk = replace(sampling, max_tokens=min(self.chunk_tokens, limit))
        samples = generate(prompts, n, chunk)
        for group in samples:
            for sample in group:
                sample.token_versions = sample.versions()
        while unfinished := self._unfinished(samples, limit):
            self.between_chunks()
            length = len(samples[unfinished[0][0]][unfinished[0][1]].token_ids)
            contexts = [[*prompts[i], *samples[i][j].token_ids] for i, j in unfinished]
            step = replace(sampling, max_tokens=min(self.chunk_tokens, limit - length))
            for (i, j), (more,) in zip(unfinished, generate(contexts, 1, step), strict=True):
                _extend(samples[i][j], more)
        return samples

    def _unfinished(self, samples: list[list[Sample]], limit: int) -> list[tuple[int, int]]:
        return [
            (i, j)
            for i, group in enumerate(samples)
            for j, sample in enumerate(group)
            if sample.finish_reason == "length" and len(sample.token_ids) < limit
        ]


def _extend(sample: Sample, more: Sample) -> None:
    """`more`, generated from `sample`'s tokens, appended to it."""
    assert sample.token_versions is not None
    sample.token_ids += more.token_ids
    sample.logprobs += more.logprobs
    sample.token_versions += more.versions()
    sample.finish_reason = more.finish_reason


@dataclass(frozen=True)
class VersionSpan:
    """The policy versions of one episode's sampled tokens, and how many of them were too old
    to train (`rollout.max_offpolicy_steps`)."""

    oldest: int
    newest: int
    offpolicy_tokens: int = 0

    @classmethod
    def of(cls, versions: list[int], oldest_trained: int | None) -> VersionSpan:
        stale = 0 if oldest_trained is None else sum(v < oldest_trained for v in versions)
        return cls(min(versions), max(versions), stale)

    def __or__(self, other: VersionSpan) -> VersionSpan:
        """Both turns' tokens."""
        return VersionSpan(
            min(self.oldest, other.oldest),
            max(self.newest, other.newest),
            self.offpolicy_tokens + other.offpolicy_tokens,
        )


def partial_metrics(spans: list[VersionSpan]) -> dict[str, float]:
    """`rollout/partial_frac`: the share of episodes sampled by more than one policy version;
    `rollout/version_spread`: the newest minus the oldest version among the step's tokens;
    `rollout/offpolicy_tokens`: sampled tokens left out of the loss as too old."""
    if not spans:
        return {}
    return {
        "rollout/partial_frac": sum(s.newest > s.oldest for s in spans) / len(spans),
        "rollout/version_spread": float(
            max(s.newest for s in spans) - min(s.oldest for s in spans)
        ),
        "rollout/offpolicy_tokens": float(sum(s.offpolicy_tokens for s in spans)),
    }
