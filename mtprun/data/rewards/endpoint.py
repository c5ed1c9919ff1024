"""An LLM judge behind an OpenAI-compatible endpoint (`task.reward: {url, model, prompt,
parse}`): render the prompt template with the episode, POST one chat completion, read the
score out of the reply with the `parse` regex or function (both shared with the judge the run
serves itself, mtprun.runner.rollout.scorers).

`EndpointJudge.score` is one episode, synchronous, under a deadline: connection failures,
timeouts, 429 and 5xx answers are retried with backoff until `retries` or the deadline runs
out; anything else (a 4xx, a reply that is not a chat completion, a reply the regex finds no
number in) raises at once. The runner calls it from a thread pool of `concurrency` threads and
turns what it raises into `reward/errors` (task.reward_on_error).
"""

from __future__ import annotations

import functools
import json
import os
import re
import string
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mtprun.data.http import PostFailed, post
from mtprun.data.references import UnresolvedReference, load_reference
from mtprun.data.rewards.call import RewardInput, RewardValueError, reward_components
from mtprun.spec.rewards import is_parse_function

if TYPE_CHECKING:
    from mtprun.spec.rewards import EndpointReward

TEMPLATE_FIELDS = ("question", "completion", "answer", "reasoning", "prompt")


class JudgeError(RuntimeError):
    """The endpoint did not give a usable score; the message says why."""


def template_fields(template: str) -> list[str]:
    """The field names a format-string template uses; ValueError for a malformed one."""
    fields = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            fields.append(field)
    return fields


def template_problem(path: str) -> str | None:
    """What is wrong with the judge's prompt template at `path`, or None."""
    try:
        with open(path, encoding="utf-8") as file:
            template = file.read()
    except OSError as err:
        return f"cannot read the judge's prompt template: {err.strerror}: {path}"
    try:
        fields = template_fields(template)
    except ValueError as err:
        return f"{path} is not a format template: {err} (write {{{{ and }}}} for literal braces)"
    for field in fields:
        base = re.split(r"[.\[]", field, maxsplit=1)[0]
        if base == "" or base.isdigit():
            return f"{path}: a positional field {{{field}}}; name the field: " + ", ".join(
                f"{{{f}}}" for f in TEMPLATE_FIELDS
            )
        if base not in TEMPLATE_FIELDS:
            from mtprun.spec.errors import did_you_mean

            return (
                f"{path}: the template's field {{{field}}} is not one mtprun fills"
                f"{did_you_mean(base, TEMPLATE_FIELDS)}; fields: "
                + ", ".join(f"{{{f}}}" for f in TEMPLATE_FIELDS)
                + " ({prompt[<column>]}: a column of the prompt's record); write {{ and }} for "
                "literal braces"
            )
    return None


def render(template: str, episode: RewardInput) -> str:
    """The judge's user message for `episode`."""
    question = next((m["content"] for m in reversed(episode.messages) if m["role"] == "user"), "")
    try:
        return template.format(
            question=question,
            completion=episode.completion,
            answer=episode.answer or "",
            reasoning=episode.reasoning,
            prompt=episode.prompt,
        )
    except (KeyError, IndexError, AttributeError) as err:
        raise JudgeError(
            f"the judge's prompt template names {err}, which this prompt lacks"
        ) from None


ScoreReader = Callable[[str], float]
"""A judge's reply -> its score (raises RewardValueError when there is none)."""


def score_reader(parse: str) -> ScoreReader:
    """How `parse` (a regular expression or a function reference, see
    mtprun.spec.rewards.is_parse_function) reads the score out of a reply; raises
    UnresolvedReference for a function that does not import."""
    if not is_parse_function(parse):
        return functools.partial(parse_score, parse)
    fn = load_reference(parse)
    if not callable(fn):
        raise UnresolvedReference(f"parse {parse}: a {type(fn).__name__}, not a function")
    return functools.partial(_call_parse, fn, parse)


def parse_problem(parse: str) -> str | None:
    """What is wrong with a judge's `parse` function (importing it), or None."""
    try:
        score_reader(parse)
    except UnresolvedReference as err:
        return str(err)
    return None


def _call_parse(fn: Callable[[str], Any], parse: str, reply: str) -> float:
    try:
        return reward_components(fn(reply))["total"]
    except RewardValueError as err:
        raise RewardValueError(f"parse {parse} on the reply {reply!r:.200}: {err}") from None


def parse_score(pattern: str, reply: str) -> float:
    """The score in the judge's `reply`: the first group (or whole match) of `pattern`'s first
    match; RewardValueError when there is none or it is not a number."""
    found = re.search(pattern, reply)
    if found is None:
        raise RewardValueError(f"the judge's reply has no match of {pattern!r}: {reply!r:.300}")
    text = found.group(1) if found.re.groups else found.group(0)
    try:
        return float(text)
    except (TypeError, ValueError):
        raise RewardValueError(
            f"the judge's score {text!r} (parse {pattern!r}) is not a number; reply: {reply!r:.300}"
        ) from None


class EndpointJudge:
    """One judge: its template read once, one request per `score` call (thread-safe)."""

    def __init__(self, spec: EndpointReward) -> None:
        self.spec = spec
        with open(spec.prompt, encoding="utf-8") as file:
            self.template = file.read()
        self.read_score = score_reader(spec.parse)
        url = spec.url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else f"{url}/chat/completions"

    def score(self, episode: RewardInput, deadline: float) -> dict[str, float]:
        """The judge's score of `episode` as reward components; raises JudgeError or
        RewardValueError, or TimeoutError once `deadline` (time.monotonic) has passed."""
        body = json.dumps(
            {
                "model": self.spec.model,
                "messages": [{"role": "user", "content": render(self.template, episode)}],
                "temperature": self.spec.temperature,
                "max_tokens": self.spec.max_tokens,
            }
        ).encode()
        reply = self._post(body, deadline)
        return {"total": self.read_score(reply)}

    def _post(self, body: bytes, deadline: float) -> str:
        headers = {"Content-Type": "application/json"}
        if self.spec.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(self.spec.api_key_env, '')}"
        try:
            return _reply_text(post(self.url, body, headers, self.spec.retries, deadline))
        except PostFailed as err:
            if err.final:
                raise JudgeError(str(err)) from None
            if not err.attempts:
                raise TimeoutError(f"no time left to call {self.url}") from None
            raise JudgeError(f"the judge failed after {err.attempts} attempt(s): {err}") from None


def _reply_text(raw: bytes) -> str:
    """The message content of a chat completion response."""
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"the endpoint's answer is not a chat completion: {raw[:300]!r}") from None
    if not isinstance(content, str):
        raise JudgeError(f"the endpoint's reply content is {content!r:.100}, not text")
    return content
