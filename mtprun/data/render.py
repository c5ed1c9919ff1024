"""Conversation -> token ids with, per token, the role that authored it and whether the model
sampled it.

For the template families in `mtprun.data.templates` the format knows which pieces the model
emits (its content, tool-call markup, and its stop token, also where the template files that
token under the next message). A model family the `renderers` library covers (Qwen3, GLM-4.5,
...) renders through it (`mtprun.data.templates.family`), its per-token sampled mask giving
the labels. Any other chat template (a model folder's own) is attributed token by token by
rendering the conversation incrementally with it (`mtprun.data.templates.model_template`):
the same labels, derived from the template itself.

A conversation's tool specs (`tools`) are printed by the template. In RL the renderer also
reads generated turns back (`parse_turn`: reasoning, answer, tool calls) and extends an
episode's tokens turn by turn, token-in, token-out (`next_turn`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from mtprun.data.messages import ROLES, Message, Role, ToolSpec
from mtprun.data.templates import ChatFormat, chat_format_of_template
from mtprun.data.templates.family import FamilyTemplate, family_template
from mtprun.data.templates.model_template import ModelTemplate, TokenLabels
from mtprun.data.templates.reasoning import prompt_opens_reasoning
from mtprun.data.tokenizer import build_tokenizer

ROLE_IDS: dict[Role, int] = {role: i for i, role in enumerate(ROLES)}


@dataclass(frozen=True)
class RenderedSequence:
    """One token sequence with per-token labels; all tensors have the same length N.

    token_ids:  [N] int64.
    roles:      [N] int8 index into ROLES: the author of the token (a stop token the model
                sampled is the assistant's, whichever message the template files it under).
    is_sampled: [N] bool, True where the model emits the token at inference.
    logprobs:   [N] float32 logprob the rollout engine sampled each token with (0 where not
                sampled), or None outside RL.
    routed_experts: [N, L, k] int16 experts the rollout engine routed each token to per decoder
                layer, -1 where it returned none; None unless the engine returned routings
                (trainer.router_replay).
    """

    token_ids: torch.Tensor
    roles: torch.Tensor
    is_sampled: torch.Tensor
    logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    def __getitem__(self, index: slice) -> RenderedSequence:
        logprobs = None if self.logprobs is None else self.logprobs[index]
        routed = None if self.routed_experts is None else self.routed_experts[index]
        return replace(
            self,
            token_ids=self.token_ids[index],
            roles=self.roles[index],
            is_sampled=self.is_sampled[index],
            logprobs=logprobs,
            routed_experts=routed,
        )

    def role_names(self) -> list[Role]:
        return [ROLES[i] for i in self.roles.tolist()]


class Renderer:
    """Renders conversations with a tokenizer's chat template.

    Use `render` for RL prompts, `render_training` for SFT records, `next_turn` for the
    tokens the environment inserts between two model turns, `parse_turn` to read a generated
    turn back, and `stop_token_ids` for the rollout engine.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_format: ChatFormat | None = None,
        family: FamilyTemplate | None = None,
    ) -> None:
        """`chat_format` None: the format whose Jinja template the tokenizer carries (as
        `build_tokenizer` sets it), else `family` (a `renderers` model family), else the
        tokenizer's own template, attributed by incremental rendering. Given: render with
        that format (e.g. chatml with a real Qwen tokenizer, whose own template differs in
        details); the tokenizer must hold each of its special tokens as one token."""
        self.tokenizer = tokenizer
        if chat_format is not None:
            _check_special_tokens(tokenizer, chat_format)
        else:
            chat_format = chat_format_of_template(tokenizer.chat_template)
        self.chat_format = chat_format
        self.model_template: FamilyTemplate | ModelTemplate | None = None
        if chat_format is None:
            self.model_template = family if family is not None else ModelTemplate(tokenizer)

    @property
    def family(self) -> str | None:
        """The `renderers` family this renders with (`qwen3`, ...), None for mtprun's own."""
        template = self.model_template
        return template.name if isinstance(template, FamilyTemplate) else None

    @property
    def fingerprint(self) -> str:
        """A hash that changes when rendering may: the tokenizer's vocabulary, special tokens
        or chat template, or the chat format."""
        tokenizer = self.tokenizer
        described = [
            type(tokenizer).__name__,
            sorted(tokenizer.get_vocab().items()),
            tokenizer.all_special_tokens,
            tokenizer.chat_template,
            self.chat_format.name if self.chat_format is not None else None,
            repr(self.model_template.config) if self.family is not None else None,
        ]
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids at which a model turn ends (the engine's stop tokens)."""
        if self.model_template is not None:
            return self.model_template.stop_token_ids
        return self.tokenizer.convert_tokens_to_ids(list(self.chat_format.stop_tokens))

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tools: Sequence[ToolSpec] = (),
    ) -> RenderedSequence:
        """Token ids of `messages` (the same ids as `apply_chat_template`) with their labels.

        add_generation_prompt appends the assistant's opening (not sampled), as for a prompt;
        `tools`: the tool specs the template prints (its tools header).
        """
        if not messages:
            raise ValueError("render: no messages (an empty conversation has nothing to train)")
        if self.model_template is not None:
            return _sequence(self.model_template.label(messages, add_generation_prompt, tools))
        self._check_no_tools(tools)
        pieces = list(self.chat_format.pieces(messages, add_generation_prompt))
        encoded = self.tokenizer([p.text for p in pieces], add_special_tokens=False)["input_ids"]
        token_ids = torch.tensor(list(chain.from_iterable(encoded)), dtype=torch.int64)
        # Each piece's role and sampled flag per token, expanded in Python: torch's
        # repeat_interleave forks its thread pool per call (~3 ms on a busy 2-core machine,
        # against microseconds here), once per rendered conversation.
        pairs = list(zip(pieces, encoded, strict=True))
        roles = chain.from_iterable([ROLE_IDS[p.role]] * len(ids) for p, ids in pairs)
        sampled = chain.from_iterable([p.sampled] * len(ids) for p, ids in pairs)
        return RenderedSequence(
            token_ids=token_ids,
            roles=torch.tensor(list(roles), dtype=torch.int8),
            is_sampled=torch.tensor(list(sampled), dtype=torch.bool),
        )

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> list[RenderedSequence]:
        """The sequences SFT trains on `messages`: every assistant turn as the model sees it
        when that turn is the newest.

        One sequence (`render`) where the template renders earlier turns as it rendered them
        when they were the newest. A template that rewrites history (Qwen3 drops the reasoning
        of turns before the last user query) trains the conversation's full rendering on the
        turns it renders unchanged, and each other assistant turn in a sequence of its own,
        the conversation up to that turn, trained on that turn only.
        """
        template = self.model_template
        if not isinstance(template, FamilyTemplate) or template.is_prefix_stable:
            return [self.render(messages, tools=tools)]
        if not messages:
            raise ValueError("render: no messages (an empty conversation has nothing to train)")
        full = template.label(messages, add_generation_prompt=False, tools=tools)
        sampled = list(full.sampled)
        extra = []
        for i, message in enumerate(messages[:-1]):
            if message.role != "assistant":
                continue
            newest = template.label(messages[: i + 1], add_generation_prompt=False, tools=tools)
            if full.token_ids[: len(newest.token_ids)] == newest.token_ids:
                continue  # rendered in the full conversation as when it was the newest
            sampled = [s and m != i for s, m in zip(sampled, full.message_indices, strict=True)]
            extra.append(_only_message(newest, i))
        return [_sequence(replace(full, sampled=sampled)), *(_sequence(x) for x in extra)]

    def continuation(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
    ) -> RenderedSequence:
        """The tokens to insert after the model's last turn in `history` and before its next
        turn: `new_messages` (tool results, user replies) and the next generation prompt, as
        the template renders them after that turn.

        Everything up to the model's stop token (the last sampled token of the rendering) is
        already in the trajectory: the engine sampled it.
        """
        _check_turn("continuation", history, new_messages)
        full = self.render([*history, *new_messages], add_generation_prompt=True, tools=tools)
        last_sampled = int(full.is_sampled.nonzero().max())
        return full[last_sampled + 1 :]

    def next_turn(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
    ) -> RenderedSequence:
        """The tokens to append to an episode for its next turn, token-in, token-out: the
        context of the turn the engine just sampled (`prompt_ids`) and that turn
        (`completion_ids`, whose message ends `history`) stay exactly as they are, followed
        by `new_messages` (tool results, user replies) and the next generation prompt.

        A `renderers` family extends them with its `bridge_to_next_turn`. Where it declines
        (Qwen3 at a new user query: its template would drop the earlier turns' reasoning)
        and with mtprun's own templates, the new messages are rendered as the template
        renders them after that turn (`continuation`) and appended all the same: history is
        never rendered again into the episode.
        """
        _check_turn("next_turn", history, new_messages)
        if not completion_ids:
            raise ValueError("next_turn: the sampled turn has no tokens (not even its stop)")
        if isinstance(self.model_template, FamilyTemplate):
            bridged = self.model_template.bridge(prompt_ids, completion_ids, new_messages, tools)
            if bridged is not None:
                return _sequence(bridged)
        return self.continuation(history, new_messages, tools)

    def parse_turn(
        self,
        token_ids: Sequence[int],
        prompt_ids: Sequence[int] = (),
        tools: Sequence[ToolSpec] = (),
    ) -> Message:
        """The assistant message behind a turn the engine generated (`token_ids`, after the
        context `prompt_ids`): its reasoning, its final answer (the content) and its tool
        calls. A `renderers` family reads them with its `parse_response` (told the prompt
        and the `tools`); mtprun's own templates take a leading `<think>...</think>` block as
        the reasoning and read tool calls in the template's syntax."""
        if isinstance(self.model_template, FamilyTemplate):
            return self.model_template.parse_turn(token_ids, prompt_ids, tools)
        opened = bool(prompt_ids) and prompt_opens_reasoning(
            self.tokenizer.decode(list(prompt_ids)[-16:])
        )
        return self.parse_assistant(self.tokenizer.decode(list(token_ids)), opened)

    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A generated turn's text as the model wrote it (reasoning block, answer, tool-call
        markup), without the stop token that ended it."""
        ids = list(token_ids)
        stops = set(self.stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        return self.tokenizer.decode(ids)

    def parse_assistant(self, text: str, opened_reasoning: bool = False) -> Message:
        """The assistant message (reasoning, content and tool calls) behind a generated
        turn's text; tool calls are read in the template's own syntax. `opened_reasoning`
        (mtprun's own templates): the prompt ended with `<think>`."""
        if isinstance(self.model_template, FamilyTemplate):
            return self.model_template.parse_assistant(text)
        if self.model_template is not None:
            return self.model_template.parse_assistant(text, opened_reasoning)
        return self.chat_format.parse_assistant(text, opened_reasoning)

    def _check_no_tools(self, tools: Sequence[ToolSpec]) -> None:
        if tools:
            raise ValueError(
                f"chat template {self.chat_format.name!r} prints no tool specs, and this "
                f"conversation has {len(tools)} (its `tools`): train with a model folder "
                "whose chat template (or `renderers` family) prints them, or drop the tools"
            )


def _check_turn(where: str, history: Sequence[Message], new_messages: Sequence[Message]) -> None:
    if not history or history[-1].role != "assistant":
        raise ValueError(f"{where}: history must end with the assistant's turn")
    if not new_messages or any(m.role == "assistant" for m in new_messages):
        raise ValueError(
            f"{where}: new_messages must be non-empty and hold no assistant message "
            "(the model's turns are sampled, not inserted)"
        )


def _sequence(labels: TokenLabels) -> RenderedSequence:
    return RenderedSequence(
        token_ids=torch.tensor(labels.token_ids, dtype=torch.int64),
        roles=torch.tensor([ROLE_IDS[r] for r in labels.roles], dtype=torch.int8),
        is_sampled=torch.tensor(labels.sampled, dtype=torch.bool),
    )


def _only_message(labels: TokenLabels, index: int) -> TokenLabels:
    """`labels` with only message `index`'s sampled tokens left sampled."""
    indices = labels.message_indices or []
    sampled = [s and m == index for s, m in zip(labels.sampled, indices, strict=True)]
    return replace(labels, sampled=sampled)


def _check_special_tokens(tokenizer: PreTrainedTokenizerBase, chat_format: ChatFormat) -> None:
    missing = [
        token
        for token in chat_format.special_tokens
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1
    ]
    if missing:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path or ''} has no single token for {missing} of "
            f"chat template {chat_format.name!r}: set data.template / task.template to the "
            "template family the model was trained with"
        )


RendererChoice = str | Mapping[str, object]
"""A recipe's `renderer:` setting: `auto`, `none`, a `renderers` family name, or a table
`{name: <family>, <option>: <value>}` (see `mtprun.data.templates.family`)."""


def renderer_for(
    template: str, model_path: str | None = None, renderer: RendererChoice = "auto"
) -> Renderer:
    """The renderer of a recipe section: for a tiny model, the char-level tokenizer of
    `template`; for an HF model folder, `folder_renderer`, as the runner renders it."""
    if model_path is None:
        return Renderer(build_tokenizer(template))
    return folder_renderer(model_path, renderer)


def folder_renderer(model_dir: str | Path, renderer: RendererChoice = "auto") -> Renderer:
    """The renderer of a model folder (the runner's saved folder or an HF checkpoint): its
    own tokenizer, rendering through the `renderers` family that `renderer` selects (see
    `mtprun.data.templates.family`), else with the folder's own chat template."""
    # Imported here: the auto classes pull in most of transformers (seconds).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_format_of_template(tokenizer.chat_template) is not None:
        return Renderer(tokenizer)  # one of mtprun's own (tiny) templates
    return Renderer(tokenizer, family=family_template(tokenizer, renderer, model_dir))
