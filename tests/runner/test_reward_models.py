"""Reward models the run serves (`task.reward: {model, kind}`) as the run scores episodes: a
tiny random-init sequence classifier on vLLM's pooling runner and a tiny causal LM serving two
judges (each with its own template, parse function and max_tokens), combined with a rule
reward in task.rewards: two engines, one Ray actor each, the judges sharing theirs.

The classifier's scores equal transformers' forward on the same rendered conversation
(float32); each judge's replies (greedy, fetched from the shared actor with that judge's
settings) go through its own `parse`, and every reply it cannot read, every conversation too
long for the model and every template field a prompt lacks counts in reward/errors and scores
reward_on_error, never raising, its message naming the term. An endpoint judge takes a parse
function too."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mtprun.data.messages import Message
from mtprun.data.rewards import RewardInput
from mtprun.data.rewards.endpoint import render
from mtprun.data.tasks import Prompt
from mtprun.runner.rollout.reward_outcome import RewardOutcome
from mtprun.runner.rollout.rewards import EpisodeScorer
from mtprun.runner.rollout.scorers import ScorerPlacement, label_logit
from mtprun.spec.rewards import FunctionRewardTerm, ServedRewardTerm

from .reward_model_folders import build_tiny_classifier

JUDGE_TEMPLATE = "Question: {question}\nAnswer: {completion}\nReference: {answer}\nScore:"
OP_TEMPLATE = "Op: {prompt[op]}\nAnswer: {completion}\n"
PARSE = __file__.replace("test_reward_models.py", "judge_parse.py")
ON_ERROR = -1.0
OP_WEIGHT = 0.25
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer):
    return build_tiny_classifier(tokenizer, tmp_path_factory.mktemp("rm"), seed=1)


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("judge")
    (folder / "judge.txt").write_text(JUDGE_TEMPLATE)
    (folder / "op.txt").write_text(OP_TEMPLATE)
    return {"judge": folder / "judge.txt", "op": folder / "op.txt"}


@pytest.fixture(scope="module")
def placement(tmp_path_factory) -> ScorerPlacement:
    return ScorerPlacement(tmp_path_factory.mktemp("vllm"), cpus=0.5, gpus=0, seed=0, threads=1)


def _judge(model_dir, template, parse: str, **fields: Any) -> ServedRewardTerm:
    return ServedRewardTerm(
        model=str(model_dir), kind="judge", prompt=str(template), parse=parse, **fields
    )


@pytest.fixture(scope="module")
def combined(classifier_dir, tiny_qwen2_dir, templates, placement):
    """task.rewards: the classifier, a judge (a parse function), a rule reward, and a second
    judge on the same model with its own template, parse function and max_tokens (it reads
    every reply as a str: an error on every episode, scored reward_on_error)."""
    terms = [
        ServedRewardTerm(model=str(classifier_dir), kind="classifier", weight=0.5),
        _judge(
            tiny_qwen2_dir,
            templates["judge"],
            f"{PARSE}:length_if_even",
            max_tokens=6,
            weight=0.125,
        ),
        FunctionRewardTerm(reward="exact_answer", name="exact"),
        _judge(
            tiny_qwen2_dir,
            templates["op"],
            f"{PARSE}:garbage",
            max_tokens=3,
            weight=OP_WEIGHT,
            name="op_judge",
        ),
    ]
    scorer = EpisodeScorer(terms, workers=1, timeout_s=120, on_error=ON_ERROR, placement=placement)
    yield scorer
    scorer.close()


COMPLETIONS = ["42", "The answer is 42.", "41", "", "x" * 400]  # the last: over max_seq_len 256


def _episodes(completions: list[str]) -> tuple[list[Prompt], list[tuple[Message, ...]]]:
    prompt = Prompt((Message("user", "What is 6*7?"),), "42", {})
    conversations = [(*prompt.messages, Message("assistant", c)) for c in completions]
    return [prompt] * len(completions), conversations


def _op_episodes() -> tuple[list[Prompt], list[tuple[Message, ...]]]:
    """Two episodes answering "42": one whose prompt has the `op` column, one without."""
    with_op = Prompt((Message("user", "6*7?"),), "42", {"op": "*"})
    without_op = Prompt((Message("user", "6*7?"),), "42", {})
    prompts = [with_op, without_op]
    return prompts, [(*p.messages, Message("assistant", "42")) for p in prompts]


def _term_error(outcome: RewardOutcome, name: str) -> str | None:
    """Reward `name`'s error on the episode: its line of the combined message."""
    lines = (outcome.error or "").splitlines()
    return next((line for line in lines if line.startswith(f"reward {name}: ")), None)


def _judge_replies(scorer: EpisodeScorer, asked: list[str], max_tokens: int) -> list[str]:
    """The served judge's greedy replies to `asked`, fetched from its actor (greedy: the
    replies it gave while scoring)."""
    import ray

    (judges,) = [served for served in scorer.served.values() if served.kind == "judge"]
    requests = [(text, 0.0, max_tokens) for text in asked]
    return [reply for reply, _ in ray.get(judges.actor.judge.remote(requests))]


def _reward_model_processes() -> set[int]:
    """This test process's descendants that Ray titled as a RewardModelWorker actor (Ray's
    state API needs the dashboard, which the tests' Ray leaves out)."""
    parents, titles = {}, {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):  # not a process, or gone since
            pid = int(proc.name)
            parents[pid] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            titles[pid] = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()

    def ours(pid: int) -> bool:
        while pid > 1 and pid != os.getpid():
            pid = parents.get(pid, 0)
        return pid == os.getpid()

    worker = "ray::RewardModelWorker"
    return {pid for pid, title in titles.items() if title.startswith(worker) and ours(pid)}


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
    assert "over the model's 256" in _term_error(too_long, "reward_model")
    assert "over the model's 256" in _term_error(too_long, "judge")
    assert all(_term_error(o, "reward_model") is None for o in scores.outcomes[:-1])
    assert scores.outcomes[0].components["exact"] == 1.0


def test_judge_replies_are_parsed_and_unreadable_ones_counted(combined) -> None:
    prompts, conversations = _episodes(COMPLETIONS[:4])
    scores = combined.score(prompts, conversations)
    episodes = [RewardInput.of(p, c) for p, c in zip(prompts, conversations, strict=True)]
    asked = [render(JUDGE_TEMPLATE, e) for e in episodes]
    assert asked[0] == "Question: What is 6*7?\nAnswer: 42\nReference: 42\nScore:"
    replies = _judge_replies(combined, asked, max_tokens=6)
    for reply, outcome in zip(replies, scores.outcomes, strict=True):
        rm, exact = outcome.components["reward_model"], outcome.components["exact"]
        error = _term_error(outcome, "judge")
        if len(reply) % 2 == 0:
            assert outcome.components["judge"] == len(reply) and error is None
            judged = float(len(reply))
        else:  # the parse function raised: reward_on_error in the sum, and counted
            assert "judge" not in outcome.components
            assert "length_if_even" in error or "odd reply length" in error
            judged = ON_ERROR
        # op_judge's template needs the prompt's `op`, which these prompts lack
        total = 0.5 * rm + 0.125 * judged + exact + OP_WEIGHT * ON_ERROR
        assert outcome.components["total"] == pytest.approx(total, abs=1e-6)
    unreadable = sum(_term_error(o, "judge") is not None for o in scores.outcomes)
    assert unreadable == sum(len(r) % 2 for r in replies)
    assert scores.errors == len(replies)  # op_judge failed on every episode


def test_judge_garbage_and_missing_fields_are_errors_not_crashes(combined) -> None:
    scores = combined.score(*_op_episodes())
    assert scores.errors == 2
    errors = [_term_error(outcome, "op_judge") for outcome in scores.outcomes]
    assert "is a str" in errors[0]  # the function's result is not a number
    assert "names 'op', which this prompt lacks" in errors[1]
    for outcome in scores.outcomes:  # scored reward_on_error in the weighted sum
        parts = outcome.components
        assert "op_judge" not in parts
        others = 0.5 * parts["reward_model"] + 0.125 * parts.get("judge", ON_ERROR)
        total = others + parts["exact"] + OP_WEIGHT * ON_ERROR
        assert parts["total"] == pytest.approx(total, abs=1e-6)


def test_two_judges_on_one_model_share_one_engine_each_with_its_own_parse(combined) -> None:
    import ray

    pids = _reward_model_processes()
    served = {ray.get(s.actor.pid.remote()) for s in combined.served.values()}
    assert len(pids) == 2 and pids == served  # the classifier's engine and the judges' one
    prompts, conversations = _op_episodes()
    (outcome,) = combined.score(prompts[:1], conversations[:1]).outcomes
    asked = render(JUDGE_TEMPLATE, RewardInput.of(prompts[0], conversations[0]))
    (reply,) = _judge_replies(combined, [asked], max_tokens=6)
    # The judge's parse read the reply to its own template...
    if len(reply) % 2 == 0:
        assert outcome.components["judge"] == len(reply)
    else:
        assert "odd reply length" in _term_error(outcome, "judge")
    # ...and op_judge's, the reply to its template (this prompt has `op`), as a str.
    assert "is a str" in _term_error(outcome, "op_judge")


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
