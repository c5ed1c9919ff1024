"""Search-R1: multi-turn question answering with a search engine (`task.name: search`).

    user:      Answer the given question. ... Question: who wrote Hamlet?
    assistant: <think>...</think><search>Hamlet author</search>
    tool:      <information>Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare...
               </information>
    assistant: <think>...</think><answer>William Shakespeare</answer>

The prompts are {question, answers} rows (Search-R1's `golden_answers` column is read too);
the environment answers each `<search>query</search>` with the top_k passages of the
retriever (mtprun.data.tasks.retrieval) inside `<information>...</information>`, a tool
message: inserted, never sampled, so never trained. The episode ends at the first
`<answer>...</answer>` or after task.search.max_turns turns. Its reward is exact match,

    exact_match = 1 if normalise(answer) == normalise(a) for some reference answer a, else 0,

where normalise lower-cases, removes punctuation and the articles a, an, the, and collapses
white space (SQuAD's normalisation); logged as reward/exact_match.
"""

from __future__ import annotations

import asyncio
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtprun.data.environment import Environment, EnvStep
from mtprun.data.messages import Conversation, Message, Prompt
from mtprun.data.tasks.base import Task, step_seed
from mtprun.data.tasks.retrieval import Bm25Retriever, EndpointRetriever, Retriever

if TYPE_CHECKING:
    from mtprun.spec.data import DatasetSpec, SearchSpec

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)
"""Search-R1's prompt (its `make_prefix`, the base-model template)."""

INVALID_ACTION = (
    "My previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
ANSWER_COLUMNS = ("answers", "golden_answers", "answer")


def normalise(text: str) -> str:
    """Lower case, punctuation and the articles a, an, the removed, white space collapsed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when `prediction` normalises to any of `answers`, else 0.0."""
    guess = normalise(prediction)
    return float(any(guess == normalise(a) for a in answers))


def reference_answers(record: Any) -> list[str]:
    """The reference answers of a prompt row: its `answers` (or `golden_answers`) list, or
    its single `answer`."""
    for column in ANSWER_COLUMNS:
        value = record.get(column) if record is not None else None
        if value is None:
            continue
        if isinstance(value, str | int | float):
            return [str(value)]
        return [str(v) for v in value]
    return []


def action(text: str) -> tuple[str, str] | None:
    """The turn's first action: ("search", query) or ("answer", answer), or None."""
    found = _ACTION.search(text)
    return None if found is None else (found.group(1), found.group(2).strip())


def instructed(messages: Conversation) -> Conversation:
    """The conversation with its last user message, a bare question, put in Search-R1's
    instruction (unchanged when it already is: the task's prompts; an evaluation's own
    dataset gives bare questions)."""
    *before, last = messages
    if last.role != "user" or INSTRUCTION.partition("{")[0] in last.content:
        return messages
    return (*before, Message("user", INSTRUCTION.format(question=last.content.strip())))


class SearchEnvironment(Environment):
    """One episode's environment; `retriever` and `top_k` are set on the subclass the task
    makes (an environment class is called with no arguments)."""

    retriever: Retriever
    top_k: int = 3

    def reset(self, prompt: Prompt) -> Sequence[Message]:
        self.answers = reference_answers(prompt.record) or (
            [prompt.answer] if prompt.answer is not None else []
        )
        return instructed(prompt.messages)

    async def step(self, messages: Conversation) -> EnvStep:
        turn = messages[-1]
        found = action(turn.content) or action(turn.reasoning_content)
        if found is not None and found[0] == "answer":
            score = exact_match(found[1], self.answers)
            return EnvStep(done=True, reward=score, components={"exact_match": score})
        if found is None:
            reply = INVALID_ACTION
        else:
            passages = await asyncio.to_thread(self.retriever.search, found[1], self.top_k)
            reply = f"<information>{passages}</information>"
        # Reward 0 until it answers: an episode out of turns ends unanswered, scored 0.
        return EnvStep([Message("tool", reply)], reward=0.0, components={"exact_match": 0.0})


class SearchTask(Task):
    """Search-R1's task: the prompts of a {question, answers} dataset, each question put in
    Search-R1's instruction, answered in an environment that searches `spec.search`'s corpus
    (or endpoint)."""

    name = "search"

    def __init__(
        self,
        prompts: DatasetSpec,
        search: SearchSpec,
        seed: int,
        cache_dir: str | Path | None = None,
    ) -> None:
        from mtprun.data.prompts import PromptDataset
        from mtprun.spec.data import ColumnMap

        if prompts.columns.prompt is None and prompts.columns.messages is None:
            prompts = prompts.model_copy(update={"columns": ColumnMap(prompt="question")})
        self.data = PromptDataset(prompts, seed, cache_dir)
        self.search = search
        self.retriever: Retriever = (
            Bm25Retriever(search.corpus, cache_dir)
            if search.corpus is not None
            else EndpointRetriever(search.endpoint or "", search.retries, search.timeout_s)
        )
        self.environment = type(
            "SearchEnvironment",
            (SearchEnvironment,),
            {"retriever": self.retriever, "top_k": search.top_k},
        )

    def _wrapped(self, prompts: list[Prompt]) -> list[Prompt]:
        out = []
        for p in prompts:
            answers = reference_answers(p.record)
            answer = " | ".join(answers) if answers else p.answer
            out.append(Prompt(instructed(p.messages), answer, p.record, p.tools))
        return out

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        return self._wrapped(self.data.sample(n, seed))

    def step_prompts(self, n: int, seed: int, step: int, sampling_round: int = 0) -> list[Prompt]:
        if sampling_round:
            return self.prompts(n, step_seed(seed, step, sampling_round))
        return self._wrapped(self.data.stream((step - 1) * n, n))

    def heldout_prompts(self, n: int | None, seed: int) -> list[Prompt]:
        return self._wrapped(self.data.heldout(n))

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        """Search once for the question, then answer with the first reference answer."""
        if conversation[-1].role == "tool":
            answers = reference_answers(prompt.record) or [prompt.answer or ""]
            return Message("assistant", f"<answer>{answers[0]}</answer>")
        question = prompt.messages[-1].content.rpartition("Question: ")[2].strip()
        return Message("assistant", f"<search>{question}</search>")

    def step_metrics(self) -> dict[str, float]:
        """search/calls and search/errors since the last call (one RL step's)."""
        return self.retriever.take_counts()
