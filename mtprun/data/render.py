"""Conversation -> token ids with, per token, the role that authored it and whether the model
sampled it.

For the template families in `mtprun.data.templates` the format knows which pieces the model
emits (its content, tool-call markup, and its stop token, also where the template files that
token under the next message). Any other chat template (a model folder's own) is attributed
token by token by rendering the conversation incrementally with it
(`mtprun.data.templates.model_template`): the same labels, derived from the template itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import torch
from transformers import PreTrainedTokenizerBase

from mtprun.data.messages import ROLES, Message, Role
from mtprun.data.templates import ChatFormat, chat_format_of_template
from mtprun.data.templates.model_template import ModelTemplate
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
    """

    token_ids: torch.Tensor
    roles: torch.Tensor
    is_sampled: torch.Tensor
    logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    def __getitem__(self, index: slice) -> RenderedSequence:
        logprobs = None if self.logprobs is None else self.logprobs[index]
        return replace(
            self,
            token_ids=self.token_ids[index],
            roles=self.roles[index],
            is_sampled=self.is_sampled[index],
            logprobs=logprobs,
        )

    def role_names(self) -> list[Role]:
        return [ROLES[i] for i in self.roles.tolist()]


class Renderer:
    """Renders conversations with a tokenizer's chat template.

    Use `render` for SFT records and RL prompts, `continuation` for the tokens the environment
    inserts between two model turns, `parse_assistant` to read a generated turn back, and
    `stop_token_ids` for the rollout engine.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, chat_format: ChatFormat | None = None
    ) -> None:
        """`chat_format` None: the format whose Jinja template the tokenizer carries (as
        `build_tokenizer` sets it), else the tokenizer's own template, attributed by
        incremental rendering. Given: render with that format (e.g. chatml with a real Qwen
        tokenizer, whose own template differs in details); the tokenizer must hold each of its
        special tokens as one token."""
        self.tokenizer = tokenizer
        if chat_format is not None:
            _check_special_tokens(tokenizer, chat_format)
        else:
            chat_format = chat_format_of_template(tokenizer.chat_template)
        self.chat_format = chat_format
        self.model_template = None if chat_format is not None else ModelTemplate(tokenizer)

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
        ]
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids at which a model turn ends (the engine's stop tokens)."""
        if self.model_template is not None:
            return self.model_template.stop_token_ids
        return self.tokenizer.convert_tokens_to_ids(list(self.chat_format.stop_tokens))

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> RenderedSequence:
        """Token ids of `messages` (the same ids as `apply_chat_template`) with their labels.

        add_generation_prompt appends the assistant's opening (not sampled), as for a prompt.
        """
        if not messages:
            raise ValueError("render: no messages (an empty conversation has nothing to train)")
        if self.model_template is not None:
            labels = self.model_template.label(messages, add_generation_prompt)
            return RenderedSequence(
                token_ids=torch.tensor(labels.token_ids, dtype=torch.int64),
                roles=torch.tensor([ROLE_IDS[r] for r in labels.roles], dtype=torch.int8),
                is_sampled=torch.tensor(labels.sampled, dtype=torch.bool),
            )
        pieces = list(self.chat_format.pieces(messages, add_generation_prompt))
        encoded = self.tokenizer([p.text for p in pieces], add_special_tokens=False)["input_ids"]
        lengths = torch.tensor([len(ids) for ids in encoded])
        token_ids = torch.tensor(list(chain.from_iterable(encoded)), dtype=torch.int64)
        roles = torch.tensor([ROLE_IDS[p.role] for p in pieces], dtype=torch.int8)
        sampled = torch.tensor([p.sampled for p in pieces], dtype=torch.bool)
        return RenderedSequence(
            token_ids=token_ids,
            roles=roles.repeat_interleave(lengths),
            is_sampled=sampled.repeat_interleave(lengths),
        )

    def continuation(
        self, history: Sequence[Message], new_messages: Sequence[Message]
    ) -> RenderedSequence:
        """The tokens to insert after the model's last turn in `history` and before its next
        turn: `new_messages` (tool results, user replies) and the next generation prompt.

        Everything up to the model's stop token (the last sampled token of the rendering) is
        already in the trajectory: the engine sampled it.
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("continuation: history must end with the assistant's turn")
        if not new_messages or any(m.role == "assistant" for m in new_messages):
            raise ValueError(
                "continuation: new_messages must be non-empty and hold no assistant message "
                "(the model's turns are sampled, not inserted)"
            )
        full = self.render([*history, *new_messages], add_generation_prompt=True)
        last_sampled = int(full.is_sampled.nonzero().max())
        return full[last_sampled + 1 :]

    def parse_assistant(self, text: str) -> Message:
        """The assistant message (content and tool calls) behind a generated turn's text;
        tool calls are read in the template's own syntax."""
        if self.model_template is not None:
            return self.model_template.parse_assistant(text)
        return self.chat_format.parse_assistant(text)


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


def renderer_for(template: str, model_path: str | None = None) -> Renderer:
    """The renderer of a recipe section: for a tiny model, the char-level tokenizer of
    `template`; for an HF model folder, the folder's own tokenizer and chat template, as the
    runner renders it."""
    if model_path is None:
        return Renderer(build_tokenizer(template))
    # Imported here: the auto classes pull in most of transformers (seconds).
    from transformers import AutoTokenizer

    return Renderer(AutoTokenizer.from_pretrained(model_path))
