"""verifiers environments as mtprun tasks: `task.environment: verifiers:<module>`.

verifiers (>= 0.4, `verifiers.v1`) describes an environment as a taskset: a `vf.Taskset`
whose `load()` yields `vf.Task`s, each holding its row (`TaskData`: `prompt`,
`system_prompt` and the taskset's own fields such as `answer`), its weighted `@vf.reward`
functions (the rubric) and the tools it offers (`vf.Toolset`s of `@vf.tool` methods).
verifiers runs such a taskset with a harness program that talks to the policy through an
OpenAI client; mtprun runs it in its own episode loop instead, so every token stays the one
its engines sampled (token-in, token-out, with their log-probs):

    the taskset's tasks            -> the task's prompts (record: the task's data, `answer`
                                      the reference answer)
    the model's turn with tool     -> one tool message per call, from the task's (and the
    calls                             taskset's) toolsets, called in-process
    a turn without tool calls      -> the episode ends
    after every turn               -> `task.score(trace)` on the conversation so far: each
                                      reward logged as reward/<name>, the weighted sum
                                      (verifiers' `trace.reward`) is the episode's reward

The module named is a taskset package as verifiers loads one (it exports its `Taskset`
subclass through `__all__`, built with its default config), or any module whose
`load_environment()` returns a `vf.Taskset`. Not supported, and refused when the recipe is
validated: infinite tasksets, tasks that need a container (`NEEDS_CONTAINER`) or a runtime to
score, and `@vf.stop` conditions (mtprun's task.max_turns and rollout.max_tokens bound an
episode). Toolset state lives in the toolset object of its episode (it is not mirrored into
`trace.state`); `@vf.metric`s are not logged.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mtprun.data.environment import EnvStep
from mtprun.data.messages import (
    Conversation,
    ConversationError,
    Message,
    Prompt,
    ToolSpec,
    parse_conversation,
)
from mtprun.data.references import UnresolvedReference, import_target
from mtprun.data.tasks.base import EVAL_PROMPTS, Task, step_seed
from mtprun.spec.data import VERIFIERS_ENVIRONMENT

log = logging.getLogger("mtprun")

FORMS = (
    "verifiers:<module> (an importable taskset module or package) or "
    "verifiers:path/to/file.py (relative to the recipe)"
)


def is_verifiers_environment(reference: str | None) -> bool:
    """Whether a task.environment value names a verifiers taskset."""
    return (reference or "").startswith(VERIFIERS_ENVIRONMENT)


@dataclass(frozen=True)
class VerifiersTool:
    """One `@vf.tool` method of a toolset, as the model sees it (`name`, `spec`) and calls it
    (`call`: its arguments validated against the method's signature, as verifiers' MCP
    server does)."""

    name: str
    spec: ToolSpec
    method: Any
    metadata: Any  # mcp's FuncMetadata of the method

    @classmethod
    def of_toolsets(cls, toolsets: Sequence[Any]) -> dict[str, VerifiersTool]:
        from mcp.server.mcpserver.utilities.func_metadata import func_metadata
        from verifiers.v1.utils.decorators import discover_decorated

        tools: dict[str, VerifiersTool] = {}
        for toolset in toolsets:
            for method in discover_decorated(toolset, "tool"):
                raw = getattr(method, "tool_name", None) or method.__name__
                # verifiers' chat harness names a tool <server>_<tool> (TOOL_PREFIX None: bare).
                name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
                if name in tools:
                    raise ValueError(f"two verifiers tools are named {name!r}")
                metadata = func_metadata(method)
                spec = {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": (method.__doc__ or "").strip(),
                        "parameters": metadata.arg_model.model_json_schema(by_alias=True),
                    },
                }
                tools[name] = cls(name, spec, method, metadata)
        return tools

    async def call(self, arguments: Mapping[str, Any]) -> str:
        """The tool's answer as text; a failure is answered as text the model can read."""
        try:
            result = await self.metadata.call_fn_with_arg_validation(
                self.method,
                inspect.iscoroutinefunction(self.method),
                dict(arguments),
                None,
            )
            blocks = self.metadata.convert_result(result).content
        except Exception as err:  # the tool's error is the model's to read, as over MCP
            return f"error: tool {self.name!r} failed: {type(err).__name__}: {err}"
        return "\n".join(getattr(b, "text", None) or str(b) for b in blocks)


class VerifiersTaskset:
    """A verifiers taskset loaded for mtprun: its tasks (in `load()` order), their prompts,
    and its taskset-wide toolsets."""

    def __init__(self, reference: str, taskset: Any) -> None:
        self.reference = reference
        self.taskset = taskset
        self.tasks: list[Any] = _bounded_tasks(reference, taskset)
        for task in {type(t): t for t in self.tasks}.values():
            _check_task(reference, task)
        self.prompts = [_prompt(reference, k, t) for k, t in enumerate(self.tasks)]
        # A prompt's record holds its task's `idx` (its place in `load()`, kept by views).
        self.task_of_idx = {t.data.idx: t for t in self.tasks}
        self.shared_toolsets = list(type(taskset).toolsets(taskset.config))
        self._shared_ready = False

    async def shared_toolsets_ready(self) -> list[Any]:
        """The taskset-wide toolsets, set up once (on the first episode)."""
        if not self._shared_ready:
            for toolset in self.shared_toolsets:
                await toolset.setup()
            self._shared_ready = True
        return self.shared_toolsets

    def environment_class(self) -> type:
        """The class mtprun makes one episode environment of (called without arguments)."""
        return type("VerifiersEpisode", (VerifiersEpisode,), {"source": self})


class VerifiersEpisode:
    """One episode of a verifiers task (see the module docstring): `reset` finds the
    prompt's task and sets up its toolsets, `step` answers tool calls and scores."""

    source: ClassVar[VerifiersTaskset]

    async def reset(self, prompt: Prompt) -> Conversation:
        self.task = self.source.task_of_idx[(prompt.record or {})["idx"]]
        self.prompt_length = len(prompt.messages)
        toolsets = list(type(self.task).toolsets(self.task.config))
        for toolset in toolsets:
            await toolset.setup()
            await toolset.setup_task(self.task)
        shared = await self.source.shared_toolsets_ready()
        self.toolbox = VerifiersTool.of_toolsets([*toolsets, *shared])
        self.tools = [tool.spec for tool in self.toolbox.values()]
        return prompt.messages

    async def step(self, messages: Conversation) -> EnvStep:
        calls = messages[-1].tool_calls
        answers = [Message("tool", await self._call(call.name, call.arguments)) for call in calls]
        reward, components = await self._score(messages)
        # Scored after every turn: the last score given counts, so an episode cut short by
        # task.max_turns is scored on what it said.
        return EnvStep(answers, done=not calls, reward=reward, components=components)

    async def _call(self, name: str, arguments: Mapping[str, Any]) -> str:
        tool = self.toolbox.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}"  # as verifiers' chat harness answers
        return await tool.call(arguments)

    async def _score(self, messages: Conversation) -> tuple[float, dict[str, float] | None]:
        """The task's rewards on the conversation: (weighted sum, {reward name: score});
        (nan, None) when scoring fails (a reward error of the episode)."""
        trace = verifiers_trace(self.task, messages, self.prompt_length)
        try:
            await self.task.score(trace)
        except Exception as err:
            log.warning("verifiers task %s: scoring failed: %s", type(self.task).__name__, err)
            return math.nan, None
        unscored = [name for name, r in trace.rewards.items() if r is None]
        if unscored:
            log.warning(
                "verifiers task %s: rewards %s not scored", type(self.task).__name__, unscored
            )
            return math.nan, None
        return trace.reward, {name: r.score for name, r in trace.rewards.items()}


class VerifiersPromptTask(Task):
    """The prompts of a verifiers taskset: RL steps walk its tasks epoch by epoch, each epoch
    in an order drawn from (seed, epoch); an evaluation reads the first tasks of an order of
    its own (tasks the training also sees: a taskset has no held-out split)."""

    def __init__(self, reference: str) -> None:
        self.name = reference
        self.source = load_verifiers_taskset(reference)
        self.environment = self.source.environment_class()

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        order = np.random.default_rng([seed, 0x7F1E]).permutation(len(self.source.prompts))
        return [self.source.prompts[int(order[i % len(order)])] for i in range(n)]

    def step_prompts(self, n: int, seed: int, step: int, sampling_round: int = 0) -> list[Prompt]:
        if sampling_round:  # extra prompts of dynamic sampling: drawn, the stream goes on
            return self.prompts(n, step_seed(seed, step, sampling_round))
        size = len(self.source.prompts)
        orders: dict[int, np.ndarray] = {}  # the epochs this step reaches
        out = []
        for position in range((step - 1) * n, step * n):
            epoch, index = divmod(position, size)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([seed, epoch]).permutation(size)
            out.append(self.source.prompts[int(orders[epoch][index])])
        return out

    def heldout_prompts(self, n: int | None, seed: int) -> list[Prompt]:
        return self.prompts(n or EVAL_PROMPTS, step_seed(seed, "eval"))


@functools.cache
def load_verifiers_taskset(reference: str) -> VerifiersTaskset:
    """The taskset `reference` (`verifiers:<module or file.py>`) names, its tasks loaded;
    ValueError saying why it cannot serve (once per process: tasks load once)."""
    target = reference.removeprefix(VERIFIERS_ENVIRONMENT)
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ValueError(
            f"{reference} needs the `verifiers` package (>= 0.4), which is not installed "
            f"({err}): pip install 'verifiers>=0.4'"
        ) from None
    try:
        module = import_target(target)
    except UnresolvedReference as err:
        if str(err).startswith("no module named"):
            raise ValueError(f"no module named {target!r}: write {FORMS}") from None
        raise ValueError(str(err)) from None
    return VerifiersTaskset(reference, _taskset_of(reference, module, vf))


def verifiers_trace(task: Any, messages: Conversation, prompt_length: int) -> Any:
    """`messages` as a verifiers trace of `task` for its rewards: one message node per
    message, in a chain; the messages after the first `prompt_length` that are the
    assistant's are the sampled ones (`trace.assistant_messages`, `trace.last_reply`)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    nodes, call_ids = [], []
    for k, message in enumerate(messages):
        sampled = k >= prompt_length and message.role == "assistant"
        if message.role == "assistant":
            ids = [f"call_{k}_{j}" for j in range(len(message.tool_calls))]
            call_ids.extend(ids)
            wire: Any = vf.AssistantMessage(
                content=message.content,
                reasoning_content=message.reasoning_content or None,
                tool_calls=[
                    vf.ToolCall(id=i, name=c.name, arguments=json.dumps(c.arguments))
                    for i, c in zip(ids, message.tool_calls, strict=True)
                ]
                or None,
            )
        elif message.role == "tool":
            # Tool messages answer the calls in order (one per call, as `step` inserts them).
            call_id = call_ids.pop(0) if call_ids else f"call_{k}"
            wire = vf.ToolMessage(tool_call_id=call_id, content=message.content)
        else:
            wire = (vf.SystemMessage if message.role == "system" else vf.UserMessage)(
                content=message.content
            )
        nodes.append(MessageNode(parent=k - 1 if k else None, message=wire, sampled=sampled))
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )


def _taskset_of(reference: str, module: Any, vf: Any) -> Any:
    """The module's taskset: `load_environment()`'s, else its `__all__` Taskset subclass
    built with its default config (as verifiers' own loader builds it)."""
    name = module.__name__
    load = getattr(module, "load_environment", None)
    if callable(load):
        try:
            taskset = load()
        except Exception as err:
            raise ValueError(
                f"{reference}: load_environment() raised {type(err).__name__}: {err}"
            ) from err
        if not isinstance(taskset, vf.Taskset):
            raise ValueError(
                f"{reference}: load_environment() returned {type(taskset).__name__}, not a "
                "verifiers Taskset (vf.Taskset: verifiers >= 0.4's environment; an Env of "
                "several agents or a verifiers < 0.4 Environment is not supported)"
            )
        return taskset
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
    classes = [
        c
        for c in exported
        if inspect.isclass(c) and issubclass(c, vf.Taskset) and c is not vf.Taskset
    ]
    if len(classes) != 1:
        found = "none" if not classes else ", ".join(c.__name__ for c in classes)
        raise ValueError(
            f"{reference}: module {name!r} is not a verifiers environment: it has no "
            "load_environment() and exports "
            + ("no" if not classes else "more than one")
            + f" vf.Taskset subclass through __all__ (found {found}); a verifiers >= 0.4 "
            "environment is a taskset package exporting exactly one"
        )
    from verifiers.v1.utils.generic import concrete_type

    taskset_cls = classes[0]
    config_cls = concrete_type(taskset_cls, vf.TasksetConfig, origin=vf.Taskset)
    try:
        config = (config_cls or vf.TasksetConfig)(id=Path(name).stem)
        return taskset_cls(config)
    except Exception as err:
        raise ValueError(
            f"{reference}: {taskset_cls.__name__}(<default config>) raised "
            f"{type(err).__name__}: {err} (a taskset that needs settings: give the module a "
            "load_environment() that builds it)"
        ) from err


def _bounded_tasks(reference: str, taskset: Any) -> list[Any]:
    if not taskset.bounded:
        raise ValueError(
            f"{reference}: {type(taskset).__name__} is infinite (INFINITE = True); mtprun "
            "needs a finite taskset: bound it in load_environment() (taskset.take(n))"
        )
    try:
        tasks = list(taskset)
    except Exception as err:
        raise ValueError(
            f"{reference}: {type(taskset).__name__}.load() raised {type(err).__name__}: {err}"
        ) from err
    if not tasks:
        raise ValueError(f"{reference}: {type(taskset).__name__}.load() yielded no tasks")
    return tasks


def _check_task(reference: str, task: Any) -> None:
    """Refuse what mtprun's in-process loop cannot run (see the module docstring)."""
    task_type = type(task)
    where = f"{reference}: task {task_type.__name__}"
    if getattr(task_type, "NEEDS_CONTAINER", False):
        raise ValueError(f"{where} needs a container (NEEDS_CONTAINER): not supported by mtprun")
    methods = {name: fn for klass in task_type.__mro__ for name, fn in vars(klass).items()}
    stops = sorted(n for n, fn in methods.items() if callable(fn) and hasattr(fn, "stop"))
    if stops:
        raise ValueError(
            f"{where} has @vf.stop conditions ({', '.join(stops)}): not supported; mtprun "
            "ends an episode at a turn without tool calls, task.max_turns or "
            "rollout.max_tokens"
        )
    rewards = sorted(n for n, fn in methods.items() if callable(fn) and hasattr(fn, "reward"))
    needs_runtime = [
        n
        for n in rewards
        if (p := inspect.signature(methods[n]).parameters.get("runtime")) is not None
        and p.default is inspect.Parameter.empty
    ]
    if needs_runtime:
        raise ValueError(
            f"{where}: rewards {needs_runtime} need a runtime (a sandbox): not supported"
        )
    if not task.hooks("reward") and not task.config.judges:
        raise ValueError(f"{where} has no @vf.reward (nor judge): nothing scores its episodes")


def _prompt(reference: str, index: int, task: Any) -> Prompt:
    """Task `index`'s prompt: its system prompt and prompt as messages, its `answer` field
    as the reference answer, its data (`idx` included) as the record."""
    data = task.data
    where = f"{reference}: task {index}"
    if data.prompt is None:
        raise ValueError(f"{where} has no prompt (a conversation the user opens is not supported)")
    raw = (
        [{"role": "user", "content": data.prompt}]
        if isinstance(data.prompt, str)
        else [m.model_dump(exclude_none=True) for m in data.prompt]
    )
    if data.system_prompt:
        raw = [{"role": "system", "content": data.system_prompt}, *raw]
    try:
        messages = parse_conversation(raw)
    except ConversationError as err:
        raise ValueError(f"{where}: its prompt is not a text conversation: {err}") from None
    record = data.model_dump(mode="json")
    answer = record.get("answer")
    return Prompt(messages, None if answer is None else str(answer), record)
