"""Reward models the run serves (`task.reward: {model, kind}`) as the run scores episodes: a
tiny random-init sequence classifier on vLLM's pooling runner and a tiny causal LM as a judge,
each in a Ray actor of its own, combined with a rule reward in task.rewards.

The classifier's scores equal transformers' forward on the same rendered conversation
(float32); the judge's replies (greedy, fetched from its actor) go through `parse`, and every
reply it cannot read, every conversation too long for the model and every template field a
prompt lacks counts in reward/errors and scores reward_on_error, never raising. An endpoint
judge takes a parse function too."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mtprun.data.messages import Message
from mtprun.data.rewards import RewardInput
from mtprun.data.rewards.endpoint import render
from mtprun.data.tasks import Prompt
from mtprun.runner.rollout.rewards import EpisodeScorer
from mtprun.runner.rollout.scorers import ScorerPlacement, label_logit
from mtprun.spec.rewards import FunctionRewardTerm, ServedReward, ServedRewardTerm

from .reward_model_folders import build_tiny_classifier

JUDGE_TEMPLATE = "Question: {question}\nAnswer: {completion}\nReference: {answer}\nScore:"
PARSE = __file__.replace("test_reward_models.py", "judge_parse.py")
ON_ERROR = -1.0
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer):
    return build_tiny_classifier(tokenizer, tmp_path_factory.mktemp("rm"), seed=1)


@pytest.fixture(scope="module")
def judge_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "judge.txt"
    path.write_text(JUDGE_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def placement(tmp_path_factory) -> ScorerPlacement:
    return ScorerPlacement(tmp_path_factory.mktemp("vllm"), cpus=0.5, gpus=0, seed=0, threads=1)


def _judge(model_dir, template, parse: str) -> ServedReward:
    return ServedReward(
        model=str(model_dir), kind="judge", prompt=str(template), parse=parse, max_tokens=6
    )


@pytest.fixture(scope="module")
def combined(classifier_dir, tiny_qwen2_dir, judge_template, placement):
    """task.rewards: the classifier, the judge (a parse function) and a rule reward."""
    terms = [
        ServedRewardTerm(model=str(classifier_dir), kind="classifier", weight=0.5),
        ServedRewardTerm(
            **_judge(tiny_qwen2_dir, judge_template, f"{PARSE}:length_if_even").model_dump(),
            weight=0.125,
        ),
        FunctionRewardTerm(reward="exact_answer", name="exact"),
    ]
    scorer = EpisodeScorer(terms, workers=1, timeout_s=120, on_error=ON_ERROR, placement=placement)
    yield scorer
    scorer.close()


COMPLETIONS = ["42", "The answer is 42.", "41", "", "x" * 400]  # the last: over max_seq_len 256


def _episodes(completions: list[str]) -> tuple[list[Prompt], list[tuple[Message, ...]]]:
    prompt = Prompt((Message("user", "What is 6*7?"),), "42", {})
    conversations = [(*prompt.messages, Message("assistant", c)) for c in completions]
    return [prompt] * len(completions), conversations


def _hf_logits(model_dir, prompt, conversation) -> torch.Tensor:
    """transformers' classification logits of the conversation in the model's chat template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    messages = RewardInput.of(prompt, conversation).messages
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_classifier_scores_equal_transformers(combined, classifier_dir) -> None:
    prompts, conversations = _episodes(COMPLETIONS)
    scores = combined.score(prompts, conversations)
    for k in range(len(COMPLETIONS) - 1):
        components = scores.outcomes[k].components
        assert components is not None, scores.outcomes[k].error
        expected = _hf_logits(classifier_dir, prompts[k], conversations[k])
        assert components["reward_model"] == pytest.approx(expected[0].item(), abs=1e-4)
    # Too long for the classifier and the judge: an error for this episode alone.
    too_long = scores.outcomes[-1]
    assert "over the model's 256" in too_long.error
    assert scores.outcomes[0].components["exact"] == 1.0


def test_judge_replies_are_parsed_and_unreadable_ones_counted(
    combined, tiny_qwen2_dir, judge_template
) -> None:
    import ray

    prompts, conversations = _episodes(COMPLETIONS[:4])
    scores = combined.score(prompts, conversations)
    judge = combined.judges[1]
    episodes = [RewardInput.of(p, c) for p, c in zip(prompts, conversations, strict=True)]
    asked = [render(JUDGE_TEMPLATE, e) for e in episodes]
    assert asked[0] == "Question: What is 6*7?\nAnswer: 42\nReference: 42\nScore:"
    replies = [reply for reply, _ in ray.get(judge.actor.judge.remote(asked))]  # greedy: same
    for reply, outcome in zip(replies, scores.outcomes, strict=True):
        rm, exact = outcome.components["reward_model"], outcome.components["exact"]
        if len(reply) % 2 == 0:
            assert outcome.components["judge"] == len(reply) and outcome.error is None
            judged = float(len(reply))
        else:  # the parse function raised: reward_on_error in the sum, and counted
            assert "judge" not in outcome.components
            assert "length_if_even" in outcome.error or "odd reply length" in outcome.error
            judged = ON_ERROR
        total = 0.5 * rm + 0.125 * judged + exact
        assert outcome.components["total"] == pytest.approx(total, abs=1e-6)
    assert scores.errors == sum(len(r) % 2 for r in replies)


def test_judge_garbage_and_missing_fields_are_errors_not_crashes(
    tiny_qwen2_dir, tmp_path, placement
) -> None:
    template = tmp_path / "judge.txt"
    template.write_text("Op: {prompt[op]}\nAnswer: {completion}\n")
    spec = _judge(tiny_qwen2_dir, template, f"{PARSE}:garbage")
    scorer = EpisodeScorer(spec, workers=1, timeout_s=120, on_error=ON_ERROR, placement=placement)
    try:
        with_op = Prompt((Message("user", "6*7?"),), "42", {"op": "*"})
        without_op = Prompt((Message("user", "6*7?"),), "42", {})
        prompts = [with_op, without_op]
        conversations = [(*p.messages, Message("assistant", "42")) for p in prompts]
        scores = scorer.score(prompts, conversations)
    finally:
        scorer.close()
    assert scores.totals == [ON_ERROR, ON_ERROR] and scores.errors == 2
    assert "is a str" in scores.outcomes[0].error  # the function's result is not a number
    assert "names 'op', which this prompt lacks" in scores.outcomes[1].error


def test_several_labels_score_the_logit_of_score_label() -> None:
    assert label_logit([0.5], None) == (0.5, None)
    assert label_logit([0.5, -1.0, 2.0], 2) == (2.0, None)
    assert label_logit([0.5, -1.0], None) == (None, "2 labels and no score_label to pick one")
    assert label_logit([0.5], 1) == (None, "score_label 1 but the model has 1 labels")


def test_an_endpoint_judge_takes_a_parse_function(tmp_path) -> None:
    from mtprun.data.rewards.endpoint import EndpointJudge
    from mtprun.spec.rewards import EndpointReward

    from .judge_stub import JudgeStub

    stub = JudgeStub()  # answers "Fine.\nScore: 2" to a message without "Answer: 42"
    template = tmp_path / "judge.txt"
    template.write_text("{completion}")
    try:
        spec = EndpointReward(
            url=stub.url, model="stub", prompt=str(template), parse=f"{PARSE}:length_if_even"
        )
        prompts, conversations = _episodes(["42"])
        episode = RewardInput.of(prompts[0], conversations[0])
        reply = "Fine.\nScore: 2"  # 14 characters: length_if_even reads 14
        assert EndpointJudge(spec).score(episode, time.monotonic() + 30) == {"total": len(reply)}
    finally:
        stub.close()
