"""Rendering through the `renderers` library: a local Qwen3 folder (Qwen3's official chat
template, which keeps `<think>` only on assistant turns after the last user query) renders
token-exactly as `apply_chat_template` renders each assistant turn when it is the newest,
with exact sampled masks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from mtprun.data.mask import token_mask
from mtprun.data.messages import Message, ToolCall, parse_conversation
from mtprun.data.render import RenderedSequence, Renderer, folder_renderer
from mtprun.data.tokenizer import build_char_tokenizer

from .qwen3_folder import QWEN3_SPECIALS, write_qwen3_folder

QUESTION = Message("user", "What is 3*4?")
ANSWER = Message("assistant", "12", reasoning_content="3*4 is 12.")
FOLLOW_UP = Message("user", "And 5*5?")
SECOND_ANSWER = Message("assistant", "25", reasoning_content="5*5 is 25.")
CALL = ToolCall("calculator", {"expression": "5*5"})


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return folder_renderer(write_qwen3_folder(tmp_path_factory.mktemp("qwen3")))


def template_ids(renderer: Renderer, messages: Sequence[Message], **kwargs: object) -> list[int]:
    """The ids of the folder's own `apply_chat_template` rendering."""
    text = renderer.tokenizer.apply_chat_template(
        [m.to_dict() for m in messages], tokenize=False, **kwargs
    )
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def sampled_text(renderer: Renderer, sequence: RenderedSequence) -> str:
    return renderer.tokenizer.decode(sequence.token_ids[sequence.is_sampled])


def test_auto_picks_the_qwen3_family_from_the_folder(qwen3: Renderer) -> None:
    assert qwen3.family == "qwen3"
    im_end, endoftext = qwen3.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(qwen3.stop_token_ids) == {im_end, endoftext}


def test_single_turn_with_reasoning_is_exact(qwen3: Renderer) -> None:
    conversation = (QUESTION, ANSWER)
    (sequence,) = qwen3.render_training(conversation)
    assert sequence.token_ids.tolist() == template_ids(qwen3, conversation)
    assert sampled_text(qwen3, sequence) == "<think>\n3*4 is 12.\n</think>\n\n12<|im_end|>"
    # Sampled tokens are the assistant's; the opener and the trailing newline are not sampled.
    roles = sequence.role_names()
    assert all(
        r == "assistant" for r, s in zip(roles, sequence.is_sampled.tolist(), strict=True) if s
    )
    text = qwen3.tokenizer.decode(sequence.token_ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n3*4 is 12.\n</think>\n\n12<|im_end|>\n")
    user = 1 + len("user\nWhat is 3*4?") + 2  # <|im_start|>, characters, <|im_end|>, "\n"
    assert roles == ["user"] * user + ["assistant"] * (len(roles) - user)


def test_single_turn_without_reasoning_trains_the_empty_think_block(qwen3: Renderer) -> None:
    conversation = (QUESTION, Message("assistant", "12"))
    (sequence,) = qwen3.render_training(conversation)
    assert sequence.token_ids.tolist() == template_ids(qwen3, conversation)
    assert sampled_text(qwen3, sequence) == "<think>\n\n</think>\n\n12<|im_end|>"


def test_multi_turn_trains_each_turn_as_the_newest(qwen3: Renderer) -> None:
    conversation = (QUESTION, ANSWER, FOLLOW_UP, SECOND_ANSWER)
    full, first = qwen3.render_training(conversation)
    # The whole conversation, as the template renders it (the first turn's reasoning
    # dropped), trains the last turn only.
    assert full.token_ids.tolist() == template_ids(qwen3, conversation)
    assert "3*4 is 12." not in qwen3.tokenizer.decode(full.token_ids)
    assert sampled_text(qwen3, full) == "<think>\n5*5 is 25.\n</think>\n\n25<|im_end|>"
    # The first turn, in a sequence of its own, as the model saw it when it was the newest.
    assert first.token_ids.tolist() == template_ids(qwen3, conversation[:2])
    assert sampled_text(qwen3, first) == "<think>\n3*4 is 12.\n</think>\n\n12<|im_end|>"


def test_tool_turns_after_the_last_query_keep_their_reasoning_in_one_sequence(
    qwen3: Renderer,
) -> None:
    conversation = (
        FOLLOW_UP,
        Message("assistant", "", (CALL,), reasoning_content="Use the tool."),
        Message("tool", "25"),
        SECOND_ANSWER,
    )
    (sequence,) = qwen3.render_training(conversation)
    assert sequence.token_ids.tolist() == template_ids(qwen3, conversation)
    assert sampled_text(qwen3, sequence) == (
        "<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*5"}}\n</tool_call>'
        "<|im_end|><think>\n5*5 is 25.\n</think>\n\n25<|im_end|>"
    )
    tool = token_mask(sequence, {"tool": True})
    assert not tool.any()
    assert token_mask(sequence, {"assistant": True}).equal(token_mask(sequence, "sampled"))
    assert token_mask(sequence, "all").all()


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_prompts_render_as_the_template_with_its_options(tmp_path: Path, enable_thinking) -> None:
    renderer = folder_renderer(
        write_qwen3_folder(tmp_path), {"name": "qwen3", "enable_thinking": enable_thinking}
    )
    prompt = renderer.render((QUESTION,), add_generation_prompt=True)
    want = template_ids(
        renderer, (QUESTION,), add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert prompt.token_ids.tolist() == want
    assert not prompt.is_sampled.any()
    assert prompt.role_names()[-1] == "assistant"  # the generation prompt


def test_a_generated_turn_parses_into_reasoning_content_and_tool_calls(qwen3: Renderer) -> None:
    text = "<think>\nthink hard\n</think>\n\n12<|im_end|>"
    assert qwen3.parse_assistant(text) == Message("assistant", "12", (), "think hard")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*5"}}\n</tool_call>'
    parsed = qwen3.parse_assistant(f"<think>\nx\n</think>\n\n{call}<|im_end|>")
    assert parsed.tool_calls == (CALL,)


def test_a_folder_whose_template_is_not_the_familys_keeps_own_attribution(tmp_path) -> None:
    write_qwen3_folder(tmp_path)
    tokenizer = build_char_tokenizer(
        QWEN3_SPECIALS,
        "<|im_end|>",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    tokenizer.save_pretrained(tmp_path)
    renderer = folder_renderer(tmp_path)
    assert renderer.family is None and renderer.model_template is not None


def test_reasoning_content_is_read_from_records() -> None:
    record = {"messages": [QUESTION.to_dict(), ANSWER.to_dict()]}
    assert parse_conversation(record) == (QUESTION, ANSWER)
