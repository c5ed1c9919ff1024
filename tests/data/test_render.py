from __future__ import annotations

import random

import pytest
import torch

from mtprun.data.messages import Message, ToolCall
from mtprun.data.render import ROLE_IDS, Renderer
from mtprun.data.templates import get_chat_format
from mtprun.data.tokenizer import build_tokenizer


def chat_template_ids(renderer: Renderer, messages, add_generation_prompt: bool) -> list[int]:
    return list(
        renderer.tokenizer.apply_chat_template(
            [m.to_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
            return_dict=True,
        )["input_ids"]
    )


def sampled_text(renderer: Renderer, messages) -> list[str]:
    """The runs of sampled tokens, decoded."""
    seq = renderer.render(messages)
    runs, current = [], []
    for token, sampled in zip(seq.token_ids.tolist(), seq.is_sampled.tolist(), strict=True):
        if sampled:
            current.append(token)
        elif current:
            runs.append(renderer.tokenizer.decode(current))
            current = []
    if current:
        runs.append(renderer.tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_ids_match_the_tokenizers_chat_template(
    renderer: Renderer, add_generation_prompt: bool, random_conversation
) -> None:
    rng = random.Random()
    for _ in range(30):
        messages = random_conversation(rng)
        seq = renderer.render(messages, add_generation_prompt)
        assert seq.token_ids.tolist() == chat_template_ids(
            renderer, messages, add_generation_prompt
        )
        assert len(seq.roles) == len(seq.is_sampled) == len(seq)


def test_prompt_has_no_sampled_token(renderer: Renderer) -> None:
    seq = renderer.render([Message("system", "s"), Message("user", "hi")], True)
    assert not seq.is_sampled.any()
    expected = {
        "char": "<|system|>s<|end|><|user|>hi<|end|><|assistant|>",
        "chatml": "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n",
        "glm": "<|system|>\ns<|user|>\nhi<|assistant|>\n",
    }[renderer.chat_format.name]
    assert renderer.tokenizer.decode(seq.token_ids) == expected


def test_exactly_the_model_written_text_is_sampled(renderer: Renderer, tool_conversation) -> None:
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call>'
    expected = {
        "char": [call + "<|end|>", "12<|end|>", "You're welcome.<|end|>"],
        "chatml": [
            call.replace("<tool_call>", "<tool_call>\n").replace("</", "\n</") + "<|im_end|>",
            "12<|im_end|>",
            "You're welcome.<|im_end|>",
        ],
        # GLM: each turn's stop token is the next message's opening tag.
        "glm": [call + "<|observation|>", "12<|user|>", "You're welcome.<|endoftext|>"],
    }[renderer.chat_format.name]
    assert sampled_text(renderer, tool_conversation) == expected


def test_glm_stop_token_is_sampled_and_attributed_to_the_assistant(tool_conversation) -> None:
    renderer = Renderer(build_tokenizer("glm"))
    seq = renderer.render(tool_conversation)
    tokens = renderer.tokenizer.convert_ids_to_tokens(seq.token_ids.tolist())
    observation = tokens.index("<|observation|>")
    assert seq.is_sampled[observation]
    assert seq.roles[observation] == ROLE_IDS["assistant"]
    # The first <|user|> opens the conversation: nobody sampled it.
    user_tags = [i for i, t in enumerate(tokens) if t == "<|user|>"]
    assert not seq.is_sampled[user_tags[0]] and seq.roles[user_tags[0]] == ROLE_IDS["user"]
    assert seq.is_sampled[user_tags[1]] and seq.roles[user_tags[1]] == ROLE_IDS["assistant"]
    # The tool output itself is the tool's and not sampled.
    tool = seq.roles == ROLE_IDS["tool"]
    assert tool.sum() == len("\n" + "result: 12\n" * 5) and not seq.is_sampled[tool].any()


def test_parse_assistant_inverts_rendering(renderer: Renderer) -> None:
    rng = random.Random()
    for _ in range(20):
        calls = tuple(
            ToolCall(f"tool{i}", {"x": rng.randint(0, 99), "y": "a b"})
            for i in range(rng.randint(0, 2))
        )
        reply = Message("assistant", rng.choice(["", "ok", "two\nlines"]), calls)
        text = "".join(sampled_text(renderer, [Message("user", "q"), reply]))
        assert renderer.parse_assistant(text) == reply


def test_malformed_tool_call_stays_content(renderer: Renderer) -> None:
    text = '<tool_call>{"name": broken</tool_call>'
    assert renderer.parse_assistant(text) == Message("assistant", text)


def test_continuation_is_what_follows_the_stop_token(renderer: Renderer, tool_conversation) -> None:
    history, tool = tool_conversation[:3], tool_conversation[3]
    inserted = renderer.continuation(history, [tool])
    full = renderer.render([*history, tool], add_generation_prompt=True)
    assert not inserted.is_sampled.any()
    assert torch.equal(full.token_ids[-len(inserted) :], inserted.token_ids)
    assert full.is_sampled[-len(inserted) - 1]  # the token before is the stop token


def test_continuation_rejects_assistant_messages(renderer: Renderer, tool_conversation) -> None:
    history = tool_conversation[:3]
    with pytest.raises(ValueError, match="no assistant message"):
        renderer.continuation(history, [Message("assistant", "x")])
    with pytest.raises(ValueError, match="must end with the assistant"):
        renderer.continuation(history[:2], [Message("tool", "x")])


# A plain template mtprun does not know: GLM-like, stop token = next message's opening tag.
UNKNOWN_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@pytest.fixture
def own_template_renderer() -> Renderer:
    tokenizer = build_tokenizer("glm")
    tokenizer.chat_template = UNKNOWN_TEMPLATE
    return Renderer(tokenizer)


def test_an_unknown_template_is_attributed_from_its_own_rendering(
    own_template_renderer: Renderer,
) -> None:
    messages = [Message("user", "hi"), Message("assistant", "yo"), Message("user", "ok")]
    seq = own_template_renderer.render(messages)
    tokens = own_template_renderer.tokenizer.convert_ids_to_tokens(seq.token_ids.tolist())
    assert tokens == ["<|user|>", "h", "i", "<|assistant|>", "y", "o", "<|user|>", "o", "k"]
    # The stop token <|user|> is filed under the user by the template, but the assistant
    # sampled it; the assistant's tag is the generation prompt, which it did not.
    assert seq.role_names() == ["user"] * 3 + ["assistant"] * 4 + ["user"] * 2
    assert seq.is_sampled.tolist() == [False] * 4 + [True] * 3 + [False] * 2


def test_an_unknown_templates_generation_prompt_is_not_sampled(
    own_template_renderer: Renderer,
) -> None:
    seq = own_template_renderer.render([Message("user", "hi")], add_generation_prompt=True)
    assert seq.role_names()[-1] == "assistant" and not seq.is_sampled.any()


def test_a_forced_format_renders_with_any_tokenizer_holding_its_tokens(tool_conversation) -> None:
    reference = Renderer(build_tokenizer("chatml")).render(tool_conversation)
    other = build_tokenizer("chatml")
    other.chat_template = UNKNOWN_TEMPLATE  # e.g. a real model's own, different template
    forced = Renderer(other, chat_format=get_chat_format("chatml")).render(tool_conversation)
    assert torch.equal(forced.token_ids, reference.token_ids)
    assert torch.equal(forced.is_sampled, reference.is_sampled)


def test_a_forced_format_needs_its_special_tokens() -> None:
    with pytest.raises(ValueError, match=r"no single token for \['<\|system\|>'.*template 'glm'"):
        Renderer(build_tokenizer("chatml"), chat_format=get_chat_format("glm"))


def test_empty_conversation_is_a_clear_error(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="no messages"):
        renderer.render([], add_generation_prompt=True)
