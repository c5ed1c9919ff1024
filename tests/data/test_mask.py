from __future__ import annotations

import pytest
import torch

from mtprun.data.mask import token_mask
from mtprun.data.messages import Message
from mtprun.data.render import Renderer
from mtprun.data.tokenizer import build_tokenizer


def trained_text(renderer: Renderer, messages, policy) -> str:
    seq = renderer.render(messages)
    return renderer.tokenizer.decode(seq.token_ids[token_mask(seq, policy)])


def test_sampled_trains_what_the_model_emits(tool_conversation) -> None:
    renderer = Renderer(build_tokenizer("glm"))
    trained = trained_text(renderer, tool_conversation, "sampled")
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call>'
    assert trained == f"{call}<|observation|>12<|user|>You're welcome.<|endoftext|>"


def test_all_trains_every_token(renderer: Renderer, tool_conversation) -> None:
    seq = renderer.render(tool_conversation)
    assert token_mask(seq, "all").all()


def test_roles_table_is_sampled_and_role_flag(renderer: Renderer, tool_conversation) -> None:
    seq = renderer.render(tool_conversation)
    assistant = token_mask(seq, {"assistant": True, "tool": False})
    assert torch.equal(assistant, token_mask(seq, "sampled"))  # only the assistant samples
    # Unsampled roles stay untrained even when set to true.
    assert not token_mask(seq, {"user": True, "tool": True, "system": True}).any()
    assert not token_mask(seq, {"assistant": False}).any()


def test_glm_stop_token_survives_an_assistant_only_roles_table(tool_conversation) -> None:
    renderer = Renderer(build_tokenizer("glm"))
    trained = trained_text(renderer, tool_conversation, {"assistant": True, "tool": False})
    assert "<|observation|>" in trained and "<|user|>" in trained
    assert "result: 12" not in trained


def test_an_unknown_template_trains_the_stop_tag_of_the_next_message(tool_conversation) -> None:
    tokenizer = build_tokenizer("glm")
    tokenizer.chat_template = (
        "{%- for m in messages -%}<|{{ 'observation' if m.role == 'tool' else m.role }}|>"
        "{{ m.content }}{%- endfor -%}"
    )
    renderer = Renderer(tokenizer)
    messages = tool_conversation[4:]  # assistant "12", user, assistant
    seq = renderer.render(messages)
    assert token_mask(seq, "all").all()
    trained = renderer.tokenizer.decode(seq.token_ids[token_mask(seq, "sampled")])
    # No generation prompt in this template: the model writes its own tag too, and stops on
    # the next message's.
    assert trained == "<|assistant|>12<|user|><|assistant|>You're welcome."
    roles = token_mask(seq, {"assistant": True})
    assert torch.equal(roles, token_mask(seq, "sampled"))


def test_unknown_role_in_table_is_a_clear_error(renderer: Renderer) -> None:
    seq = renderer.render([Message("user", "x")])
    with pytest.raises(ValueError, match=r"unknown roles \['bot'\]"):
        token_mask(seq, {"assistant": True, "bot": True})


def test_unknown_policy_is_a_clear_error(renderer: Renderer) -> None:
    seq = renderer.render([Message("user", "x")])
    with pytest.raises(ValueError, match="'assistant' is not one of 'sampled', 'all'"):
        token_mask(seq, "assistant")
