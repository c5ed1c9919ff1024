"""Endpoint judges and combined rewards as the run scores episodes: a real HTTP server on
localhost (tests/runner/judge_stub.py) answering, failing with 500s, answering garbage or
gone; every failure counted in reward/errors and scored reward_on_error, never raised (only
under `fail`); several rewards (a rule function, reasoning-gym's scorer, the judge) combined
by weight, each one logged as reward/<name>."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mtprun.data.messages import Message
from mtprun.data.rewards import RewardInput
from mtprun.data.rewards.endpoint import EndpointJudge, JudgeError
from mtprun.data.tasks import Prompt
from mtprun.runner.rollout.rewards import EpisodeScorer, RewardFailed, component_means
from mtprun.spec.data import ReasoningGymSpec
from mtprun.spec.rewards import EndpointReward, EndpointRewardTerm, FunctionRewardTerm

from .judge_stub import JudgeStub

TEMPLATE = "Question: {question}\nReference: {answer}\nAnswer: {completion}\nOp: {prompt[op]}\n"


@pytest.fixture
def stub():
    server = JudgeStub()
    yield server
    server.close()


@pytest.fixture
def template(tmp_path) -> Path:
    path = tmp_path / "judge.txt"
    path.write_text(TEMPLATE)
    return path


def _judge(stub: JudgeStub, template: Path, **extra) -> EndpointReward:
    return EndpointReward(
        url=stub.url, model="stub", prompt=str(template), parse=r"Score: (\d+)", **extra
    )


def _episodes(completions: list[str]) -> tuple[list[Prompt], list[tuple[Message, ...]]]:
    prompt = Prompt((Message("user", "What is 6*7?"),), "42", {"op": "*"})
    conversations = [(*prompt.messages, Message("assistant", c)) for c in completions]
    return [prompt] * len(completions), conversations


def test_the_judge_renders_the_template_and_parses_the_score(stub, template) -> None:
    judge = EndpointJudge(_judge(stub, template, api_key_env="JUDGE_KEY_FOR_TEST"))
    prompts, conversations = _episodes(["42"])
    episode = RewardInput.of(
        prompts[0], (*conversations[0][:-1], Message("assistant", "42", reasoning_content="6*7"))
    )
    assert judge.score(episode, time.monotonic() + 10) == {"total": 10.0}
    (request,) = stub.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["body"]["model"] == "stub" and request["body"]["temperature"] == 0.0
    content = request["body"]["messages"][0]["content"]
    assert content == "Question: What is 6*7?\nReference: 42\nAnswer: 42\nOp: *\n"  # no reasoning


def test_retries_5xx_then_gives_up_with_every_failure(stub, template, monkeypatch) -> None:
    monkeypatch.setattr("mtprun.data.http.BACKOFF_S", 0.01)
    stub.mode = "error500"
    judge = EndpointJudge(_judge(stub, template, retries=2))
    prompts, conversations = _episodes(["42"])
    with pytest.raises(JudgeError, match=r"after 3 attempt\(s\): HTTP 500"):
        judge.score(RewardInput.of(prompts[0], conversations[0]), time.monotonic() + 30)
    assert len(stub.requests) == 3
    stub.mode, stub.requests = "error400", []
    with pytest.raises(JudgeError, match="HTTP 400"):  # a client error is not retried
        judge.score(RewardInput.of(prompts[0], conversations[0]), time.monotonic() + 30)
    assert len(stub.requests) == 1


def test_an_outage_and_garbage_count_as_errors_and_scoring_goes_on(stub, template) -> None:
    scorer = EpisodeScorer(_judge(stub, template, retries=1), workers=1, timeout_s=5, on_error=-1.0)
    try:
        good = scorer.score(*_episodes(["42", "41"]))
        assert good.totals == [10.0, 2.0] and good.errors == 0
        stub.mode = "garbage"
        garbage = scorer.score(*_episodes(["42"]))
        assert garbage.totals == [-1.0] and garbage.errors == 1
        assert "no match of 'Score: (\\\\d+)'" in garbage.outcomes[0].error
        stub.mode = "not_json"
        assert "not a chat completion" in scorer.score(*_episodes(["42"])).outcomes[0].error
        stub.mode = "error500"
        down = scorer.score(*_episodes(["42", "41"]))
        assert down.totals == [-1.0, -1.0] and down.errors == 2
        assert "HTTP 500" in down.outcomes[0].error
        stub.mode = "score"  # back up: scoring goes on
        assert scorer.score(*_episodes(["42"])).totals == [10.0]
    finally:
        scorer.close()


def test_a_judge_that_is_gone_or_too_slow_is_an_error(stub, template) -> None:
    scorer = EpisodeScorer(
        _judge(stub, template, retries=5), workers=1, timeout_s=1.0, on_error=0.0
    )
    try:
        stub.mode, stub.delay_s = "slow", 4.0
        start = time.monotonic()
        slow = scorer.score(*_episodes(["42", "41"]))
        assert time.monotonic() - start < 3.5  # the timeout, not the server, ends the calls
        assert slow.errors == 2 and "took longer than 1 s (task.reward_timeout_s)" in (
            slow.outcomes[0].error
        )
        stub.close()  # the server is gone: connections are refused
        gone = scorer.score(*_episodes(["42"]))
        assert gone.totals == [0.0] and gone.errors == 1
        assert "Connection refused" in gone.outcomes[0].error
    finally:
        scorer.close()


def test_requests_in_flight_stay_within_concurrency(stub, template) -> None:
    stub.mode, stub.delay_s = "slow", 0.3
    scorer = EpisodeScorer(_judge(stub, template, concurrency=2), 1, timeout_s=10, on_error=0.0)
    try:
        scores = scorer.score(*_episodes(["42"] * 6))
    finally:
        scorer.close()
    assert scores.totals == [10.0] * 6 and stub.max_in_flight == 2


def test_fail_stops_on_a_judge_error(stub, template) -> None:
    stub.mode = "garbage"
    scorer = EpisodeScorer(_judge(stub, template), workers=1, timeout_s=5, on_error="fail")
    try:
        with pytest.raises(RewardFailed, match=r"judge stub at .* failed on episode 0"):
            scorer.score(*_episodes(["42"]))
    finally:
        scorer.close()


def test_rewards_combine_by_weight_each_logged_under_its_name(stub, template) -> None:
    from mtprun.data.tasks.gym_prompts import ReasoningGymTask

    spec = ReasoningGymSpec(reasoning_gym="basic_arithmetic", size=4, config={"max_digits": 1})
    (prompt,) = ReasoningGymTask(spec, seed=0).prompts(1, seed=0)
    right, wrong = prompt.answer, "x"
    judge = _judge(stub, template).model_dump()
    judge["prompt"] = str(template.with_name("judge_gym.txt"))
    Path(judge["prompt"]).write_text("Answer: {completion}")
    terms = [
        FunctionRewardTerm(reward="reasoning_gym", weight=1.0, name="correct"),
        FunctionRewardTerm(reward="exact_answer", weight=0.5),
        EndpointRewardTerm(**judge, weight=0.1),
    ]
    # Not a timeout test: a worker's first reasoning_gym score imports it, which took over 5 s
    # on a loaded 2-core machine (the reward was killed and scored on_error).
    scorer = EpisodeScorer(terms, workers=2, timeout_s=60, on_error=-1.0)
    try:
        conversations = [
            (*prompt.messages, Message("assistant", c, reasoning_content="think"))
            for c in (right, wrong)
        ]
        scores = scorer.score([prompt, prompt], conversations)
        judge_right = 10.0 if right == "42" else 2.0
        assert scores.totals == pytest.approx([1.0 + 0.5 + 0.1 * judge_right, 0.1 * 2.0])
        assert scores.errors == 0
        assert component_means(scores.outcomes) == pytest.approx(
            {
                "reward/correct": 0.5,
                "reward/exact_answer": 0.5,
                "reward/judge": (judge_right + 2) / 2,
            }
        )
        # The judge goes down: its share scores reward_on_error, the rules still count.
        stub.close()
        down = scorer.score([prompt], conversations[:1])
        assert down.totals == pytest.approx([1.0 + 0.5 - 0.1]) and down.errors == 1
        assert down.outcomes[0].error.startswith("reward judge: judge stub at")
        assert component_means(down.outcomes) == {"reward/correct": 1.0, "reward/exact_answer": 1.0}
        # An episode its environment rewarded keeps that reward.
        given = scorer.score([prompt], conversations[:1], given=[0.25])
        assert given.totals == [0.25] and given.errors == 0
    finally:
        scorer.close()
