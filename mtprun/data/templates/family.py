"""Model families rendered by the `renderers` library (Qwen3, GLM-4.5, DeepSeek, Llama 3, ...):
token-exact Python renderings of their official chat templates, with the per-token sampled
mask that mtprun's mask policies read.

A recipe picks the family with `data.renderer` / `task.renderer`:

- `auto` (default): from the model folder's config.json (`architectures`, else
  `model_type`), mapped to a family below; used only when its rendering of probe
  conversations equals the folder's own `apply_chat_template` token for token (a fine-tune
  with an edited template falls back to mtprun's own attribution instead of training on a
  template it was not given);
- a family name, or a table `{name: qwen3, enable_thinking: false, ...}` with that family's
  options (the `renderers` config fields): used as given;
- `none`: mtprun's own attribution (`model_template.py`).

Roles come from the renderer's per-token message index: scaffolding outside every message
is the system's before the first message (a tools header) and the assistant's after it (the
generation prompt), as in mtprun's own attribution.

A rollout goes through the family too: its tool specs are printed by `render`, a generated
turn is read back from its token ids by `parse_response` (reasoning, content and tool calls,
knowing the prompt it was sampled after), and the next turn's context is the tokens already
generated extended by `bridge_to_next_turn` (see `Renderer.next_turn`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtprun.data.messages import Message, Role, ToolCall, ToolSpec
from mtprun.data.templates.model_template import TokenLabels
from mtprun.models.families import FAMILIES

log = logging.getLogger(__name__)

# A model folder's architecture (or model_type) -> the `renderers` family of its official
# template. `renderers` resolves families by hub name, which a local folder lacks. Each model
# family names its own (`Family.renderer`); these are the architectures mtprun renders without
# training them.
_RENDERED_ONLY = (
    ("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek-v3"),
    ("GptOssForCausalLM", "gpt_oss", "gpt-oss"),
)
FAMILY_OF_ARCHITECTURE: dict[str, str] = {
    **{f.architecture: f.renderer for f in FAMILIES if f.renderer},
    **{architecture: renderer for architecture, _, renderer in _RENDERED_ONLY},
}
FAMILY_OF_MODEL_TYPE: dict[str, str] = {
    **{f.model_type: f.renderer for f in FAMILIES if f.renderer and f.model_type},
    **{model_type: renderer for _, model_type, renderer in _RENDERED_ONLY},
}

_PROBES: tuple[tuple[tuple[Message, ...], bool], ...] = (
    ((Message("user", "mtprun probe question"),), True),
    (
        (
            Message("system", "mtprun probe system"),
            Message("user", "mtprun probe question"),
            Message("assistant", "mtprun probe reply", reasoning_content="mtprun probe thought"),
        ),
        False,
    ),
)


def family_of_folder(model_dir: str | Path) -> str | None:
    """The `renderers` family of a model folder's config.json, None when it maps to none."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for architecture in config.get("architectures") or ():
        if architecture in FAMILY_OF_ARCHITECTURE:
            return FAMILY_OF_ARCHITECTURE[architecture]
    return FAMILY_OF_MODEL_TYPE.get(config.get("model_type", ""))


def renderer_config(choice: str | Mapping[str, Any]) -> Any:
    """The `renderers` config of a family name or a `{name, option: value}` table."""
    from renderers.configs import _config_class_for  # the library's name -> config map

    options = {"name": choice} if isinstance(choice, str) else dict(choice)
    name = options.pop("name")
    return _config_class_for(name)(**options)


class FamilyTemplate:
    """Per-token labels, stop tokens and response parsing from a `renderers` family renderer;
    the same interface as `ModelTemplate`."""

    def __init__(self, tokenizer: Any, choice: str | Mapping[str, Any]) -> None:
        from renderers import create_renderer

        self.tokenizer = tokenizer
        self.config = renderer_config(choice)
        try:
            self.renderer = create_renderer(tokenizer, self.config)
        except Exception as err:  # the library asserts the family's special tokens exist
            raise ValueError(
                f"renderer {self.config.name!r} does not fit the tokenizer of "
                f"{tokenizer.name_or_path or 'this model'}: {err or type(err).__name__}"
            ) from err
        self.stop_token_ids: list[int] = list(self.renderer.get_stop_token_ids())

    @property
    def name(self) -> str:
        """The family name (`qwen3`, `glm-4.5`, ...)."""
        return str(self.config.name)

    @property
    def is_prefix_stable(self) -> bool:
        """False when the template rewrites earlier turns once later ones exist (Qwen3 drops
        the reasoning of turns before the last user query)."""
        return bool(self.renderer.is_prefix_stable)

    def label(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] = (),
    ) -> TokenLabels:
        """Token ids of `messages` (after the `tools` header the family prints) with each
        token's author and sampled flag."""
        rendered = self.renderer.render(
            [m.to_dict() for m in messages],
            tools=list(tools) or None,
            add_generation_prompt=add_generation_prompt,
        )
        if len(rendered.sampled_mask) != len(rendered.token_ids):
            raise ValueError(f"renderer {self.name!r} gives no sampled mask")
        return TokenLabels(
            list(rendered.token_ids),
            _roles(messages, rendered.message_indices, rendered.sampled_mask),
            list(rendered.sampled_mask),
            list(rendered.message_indices),
        )

    def bridge(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[ToolSpec] = (),
    ) -> TokenLabels | None:
        """The tokens `bridge_to_next_turn` appends to `prompt_ids + completion_ids` (a turn
        sampled after that prompt) for `new_messages` and the next generation prompt, left
        unchanged; None where the family declines to bridge (it would rewrite history, e.g.
        Qwen3 at a new user query) or would change the tokens already there."""
        previous = [*prompt_ids, *completion_ids]
        bridged = self.renderer.bridge_to_next_turn(
            list(prompt_ids),
            list(completion_ids),
            [m.to_dict() for m in new_messages],
            tools=list(tools) or None,
        )
        if bridged is None or list(bridged.token_ids[: len(previous)]) != previous:
            return None
        indices = list(bridged.message_indices[len(previous) :])
        return TokenLabels(
            list(bridged.token_ids[len(previous) :]),
            # The separator after the turn and the generation prompt are the assistant's.
            [new_messages[i].role if i >= 0 else "assistant" for i in indices],
            [False] * len(indices),
            indices,
        )

    def parse_turn(
        self,
        token_ids: Sequence[int],
        prompt_ids: Sequence[int] = (),
        tools: Sequence[ToolSpec] = (),
    ) -> Message:
        """The assistant message (content, reasoning, tool calls) behind a generated turn's
        token ids, read by the family's `parse_response`; `prompt_ids`, the context it was
        sampled after, tells reasoning the generation prompt opened."""
        parsed = self.renderer.parse_response(
            list(token_ids), tools=list(tools) or None, prompt_ids=list(prompt_ids) or None
        )
        content, calls = parsed.content or "", []
        for call in parsed.tool_calls:
            # An unknown tool's call (a family that checks names against `tools`) still
            # reaches the environment, which answers it as it answers any wrong call.
            if (
                call.status in ("ok", "unknown_tool")
                and call.name
                and isinstance(call.arguments, dict)
            ):
                calls.append(ToolCall(call.name, call.arguments))
            else:  # malformed: kept as content, so a reward sees what the model wrote
                content += call.raw
        return Message("assistant", content, tuple(calls), parsed.reasoning_content or "")

    def parse_assistant(self, text: str) -> Message:
        """The assistant message (content, reasoning, tool calls) behind a generated turn."""
        return self.parse_turn(self.tokenizer.encode(text, add_special_tokens=False))

    def matches_own_template(self) -> bool:
        """Whether the family renders probe conversations exactly as the tokenizer's own
        chat template does (ids of its `apply_chat_template` text)."""
        for messages, add_generation_prompt in _PROBES:
            dicts = [m.to_dict() for m in messages]
            try:
                text = self.tokenizer.apply_chat_template(
                    dicts, tokenize=False, add_generation_prompt=add_generation_prompt
                )
                ours = self.renderer.render(dicts, add_generation_prompt=add_generation_prompt)
            except Exception:  # a template that refuses the probe: not the family's
                return False
            if self.tokenizer.encode(text, add_special_tokens=False) != list(ours.token_ids):
                return False
        return True


def _roles(
    messages: Sequence[Message], message_indices: Sequence[int], sampled: Sequence[bool]
) -> list[Role]:
    roles: list[Role] = []
    seen_message = False
    for index, is_sampled in zip(message_indices, sampled, strict=True):
        seen_message |= index >= 0
        if is_sampled:
            roles.append("assistant")  # a sampled stop is the assistant's, wherever filed
        elif index >= 0:
            roles.append(messages[index].role)
        else:
            roles.append("assistant" if seen_message else "system")
    return roles


def family_template(
    tokenizer: Any, choice: str | Mapping[str, Any], model_dir: str | Path | None
) -> FamilyTemplate | None:
    """The `renderers` family a recipe's renderer setting selects for this tokenizer, None for
    mtprun's own attribution (`none`, or `auto` with no known family that reproduces the
    folder's template)."""
    if choice == "none":
        return None
    if choice != "auto":
        return FamilyTemplate(tokenizer, choice)
    family = family_of_folder(model_dir) if model_dir is not None else None
    if family is None:
        return None
    try:
        template = FamilyTemplate(tokenizer, family)
    except Exception as err:  # e.g. the tokenizer lacks the family's special tokens
        log.info("renderer %s does not fit %s (%s): own attribution", family, model_dir, err)
        return None
    if not template.matches_own_template():
        log.info(
            "renderer %s renders %s's template differently: own attribution", family, model_dir
        )
        return None
    return template
