"""A model folder's own chat template: exact per-token roles and sampled flags derived by
rendering incrementally with the tokenizer's `apply_chat_template`.

The templates below are written here in the style of the common families. Where the family's
text is one mtprun renders itself (ChatML, GLM, char), the attribution must equal mtprun's
built-in one token by token, on fresh random conversations; the others are checked against
labels written out by hand.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
import torch
from transformers import AutoTokenizer

from mtprun.data.messages import Message, Role, ToolCall
from mtprun.data.render import ROLE_IDS, RenderedSequence, Renderer
from mtprun.data.templates import get_chat_format
from mtprun.data.tokenizer import build_char_tokenizer, build_tokenizer
from mtprun.data.trajectory import TrajectoryBuilder

from .conftest import make_random_conversation, sampled_runs

# ChatML as Qwen writes its templates (message['...'], tool_call['function'], `{{-`), printing
# exactly mtprun's chatml text: compact call JSON, argument keys sorted.
QWEN_STYLE_CHATML = """
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message['content'] %}{{- message['content'] }}{%- endif %}
        {%- for tool_call in message['tool_calls'] or [] %}
            {%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- set fn = tool_call['function'] %}
            {{- '<tool_call>\\n{"name":' + (fn['name'] | tojson) + ',"arguments":' }}
            {{- fn['arguments'] | tojson(separators=(',', ':'), sort_keys=True) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen 2.5's habit: a default system prompt when the conversation brings none.
DEFAULT_SYSTEM_CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}" + QWEN_STYLE_CHATML
)

# ChatML whose assistant turns are marked with {% generation %} blocks (TRL style).
GENERATION_BLOCK_CHATML = """
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message['content'] }}
        {%- for tool_call in message['tool_calls'] or [] %}
            {%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- set fn = tool_call['function'] %}
            {{- '<tool_call>\\n{"name":' + (fn['name'] | tojson) + ',"arguments":' }}
            {{- fn['arguments'] | tojson(separators=(',', ':'), sort_keys=True) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# GLM-4 style: a [gMASK]<sop> preamble, role tags without closing tokens (the model stops on
# the next message's tag), a call as the tool's name on one line and its JSON arguments.
GLM4_STYLE = """[gMASK]<sop>
{%- for item in messages %}
    {%- if item['role'] == 'tool' %}<|observation|>{{ '\\n' + item['content'] }}
    {%- elif item['role'] == 'assistant' %}<|assistant|>
        {%- for tc in item['tool_calls'] or [] %}
            {{- tc['function']['name'] + '\\n' + (tc['function']['arguments'] | tojson) }}
        {%- else %}{{ '\\n' + item['content'] }}
        {%- endfor %}
    {%- else %}<|{{ item['role'] }}|>{{ '\\n' + item['content'] }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
GLM4_SPECIALS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

# Llama 3.1 style: BOS, a system block it always writes (a default one when none is given),
# header tokens, <|eot_id|> closing each turn, calls as bare JSON with "parameters", tool
# results under the `ipython` header.
LLAMA3_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'Cutting Knowledge Date: December 2023' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] }}
    {%- elif message['tool_calls'] %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- set fn = message['tool_calls'][0]['function'] %}
        {{- '{"name": "' + fn['name'] + '", "parameters": ' + (fn['arguments'] | tojson) + '}' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
)

CALL = ToolCall("calculator", {"expression": "3*4"})
TOOL_CONVERSATION = (
    Message("user", "What is 3*4?"),
    Message("assistant", "", (CALL,)),
    Message("tool", "result: 12"),
    Message("assistant", "12"),
    Message("user", "Thanks"),
    Message("assistant", "ok"),
)
Pieces = Sequence[tuple[str, Role, bool]]


def with_template(template: str, chat_template: str) -> Renderer:
    """A renderer on mtprun's char tokenizer of `template` carrying another Jinja template."""
    tokenizer = build_tokenizer(template)
    tokenizer.chat_template = chat_template
    renderer = Renderer(tokenizer)
    assert renderer.model_template is not None  # not byte-identical to a built-in
    return renderer


def expected(renderer: Renderer, pieces: Pieces) -> RenderedSequence:
    """The labels written out by hand: each piece's text with its author and sampled flag."""
    ids, roles, sampled = [], [], []
    for text, role, is_sampled in pieces:
        piece_ids = renderer.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        roles += [ROLE_IDS[role]] * len(piece_ids)
        sampled += [is_sampled] * len(piece_ids)
    return RenderedSequence(
        torch.tensor(ids), torch.tensor(roles, dtype=torch.int8), torch.tensor(sampled)
    )


def assert_same_labels(got: RenderedSequence, want: RenderedSequence, tokenizer) -> None:
    tokens = tokenizer.convert_ids_to_tokens(want.token_ids.tolist())
    assert got.token_ids.tolist() == want.token_ids.tolist()
    got_labels = list(zip(tokens, got.role_names(), got.is_sampled.tolist(), strict=True))
    want_labels = list(zip(tokens, want.role_names(), want.is_sampled.tolist(), strict=True))
    assert got_labels == want_labels


def random_conversations(count: int) -> list[tuple[Message, ...]]:
    rng = random.Random()
    return [make_random_conversation(rng) for _ in range(count)]


@pytest.mark.parametrize("template", ["char", "chatml", "glm"])
def test_a_rewritten_builtin_template_attributes_like_the_builtin(template: str) -> None:
    # The same text from a template that is not byte-identical: GLM's stop tokens filed under
    # the next message are found from the template alone.
    builtin = Renderer(build_tokenizer(template))
    own = with_template(template, "{#- rewritten -#}" + get_chat_format(template).jinja)
    assert own.stop_token_ids == sorted(builtin.stop_token_ids)
    for conversation in random_conversations(60):
        for generation_prompt in (False, True):
            assert_same_labels(
                own.render(conversation, generation_prompt),
                builtin.render(conversation, generation_prompt),
                own.tokenizer,
            )


@pytest.mark.parametrize("chat_template", [QWEN_STYLE_CHATML, GENERATION_BLOCK_CHATML])
def test_chatml_with_tool_calls_equals_mtprun_chatml(chat_template: str) -> None:
    builtin = Renderer(build_tokenizer("chatml"))
    own = with_template("chatml", chat_template)
    assert own.model_template.has_generation_blocks == (chat_template is GENERATION_BLOCK_CHATML)
    for conversation in (TOOL_CONVERSATION, *random_conversations(60)):
        for generation_prompt in (False, True):
            assert_same_labels(
                own.render(conversation, generation_prompt),
                builtin.render(conversation, generation_prompt),
                own.tokenizer,
            )
    assert own.stop_token_ids == builtin.stop_token_ids


def test_an_injected_default_system_prompt_is_the_systems_and_never_sampled() -> None:
    builtin = Renderer(build_tokenizer("chatml"))
    own = with_template("chatml", DEFAULT_SYSTEM_CHATML)
    injected = [(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n", "system", False)]
    for conversation in (TOOL_CONVERSATION, *random_conversations(60)):
        want = builtin.render(conversation, add_generation_prompt=True)
        if conversation[0].role != "system":
            preamble = expected(own, injected)
            want = RenderedSequence(
                torch.cat([preamble.token_ids, want.token_ids]),
                torch.cat([preamble.roles, want.roles]),
                torch.cat([preamble.is_sampled, want.is_sampled]),
            )
        assert_same_labels(own.render(conversation, True), want, own.tokenizer)


def test_glm4_style_stop_tokens_are_the_next_messages_tags_and_the_assistants() -> None:
    tokenizer = build_char_tokenizer((*GLM4_SPECIALS, "<|endoftext|>"), "<|endoftext|>", GLM4_STYLE)
    renderer = Renderer(tokenizer)
    stops = tokenizer.convert_ids_to_tokens(renderer.stop_token_ids)
    assert sorted(stops) == ["<|endoftext|>", "<|observation|>", "<|user|>"]
    want = expected(
        renderer,
        [
            ("[gMASK]<sop>", "system", False),  # printed before any message
            ("<|user|>\nWhat is 3*4?", "user", False),
            ("<|assistant|>", "assistant", False),
            ('calculator\n{"expression": "3*4"}', "assistant", True),
            ("<|observation|>", "assistant", True),  # filed under the tool, sampled before it
            ("\nresult: 12", "tool", False),
            ("<|assistant|>", "assistant", False),
            ("\n12", "assistant", True),
            ("<|user|>", "assistant", True),
            ("\nThanks", "user", False),
            ("<|assistant|>", "assistant", False),
            ("\nok", "assistant", True),  # the end: this template prints no stop token
            ("<|assistant|>", "assistant", False),  # the generation prompt
        ],
    )
    assert_same_labels(renderer.render(TOOL_CONVERSATION, True), want, tokenizer)
    # Calls are read back in the template's own syntax: the name, then the JSON arguments.
    assert (
        renderer.parse_assistant('calculator\n{"expression": "3*4"}<|observation|>')
        == (TOOL_CONVERSATION[1])
    )
    assert renderer.parse_assistant("\n12<|user|>") == Message("assistant", "\n12")


def test_llama3_style_headers_default_system_and_generation_config_stops(tmp_path) -> None:
    tokenizer = build_char_tokenizer(LLAMA3_SPECIALS, "<|eot_id|>", LLAMA3_STYLE)
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.save_pretrained(tmp_path)
    # The model folder's generation config also stops on <|eom_id|> and <|end_of_text|>.
    eos = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    renderer = Renderer(AutoTokenizer.from_pretrained(tmp_path))
    assert renderer.stop_token_ids == sorted(eos)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    want = expected(
        renderer,
        [
            ("<|begin_of_text|>" + header.format("system"), "system", False),
            ("Cutting Knowledge Date: December 2023<|eot_id|>", "system", False),
            (header.format("user") + "What is 3*4?<|eot_id|>", "user", False),
            (header.format("assistant"), "assistant", False),
            ('{"name": "calculator", "parameters": {"expression": "3*4"}}', "assistant", True),
            ("<|eot_id|>", "assistant", True),
            (header.format("ipython") + "result: 12<|eot_id|>", "tool", False),
            (header.format("assistant"), "assistant", False),
            ("12<|eot_id|>", "assistant", True),
            (header.format("user") + "Thanks<|eot_id|>", "user", False),
            (header.format("assistant"), "assistant", False),
            ("ok<|eot_id|>", "assistant", True),
        ],
    )
    assert_same_labels(renderer.render(TOOL_CONVERSATION), want, renderer.tokenizer)
    # Given a system message, the template writes it in place of its default one.
    system = renderer.render((Message("system", "Be brief."), *TOOL_CONVERSATION[:1]))
    assert system.role_names().count("system") == len(
        renderer.tokenizer("<|begin_of_text|>" + header.format("system") + "Be brief.<|eot_id|>")[
            "input_ids"
        ]
    )
    text = '{"name": "calculator", "parameters": {"expression": "3*4"}}<|eot_id|>'
    assert renderer.parse_assistant(text) == TOOL_CONVERSATION[1]


@pytest.mark.parametrize(
    "chat_template",
    [QWEN_STYLE_CHATML, GENERATION_BLOCK_CHATML, DEFAULT_SYSTEM_CHATML, GLM4_STYLE],
    ids=["chatml", "generation-blocks", "default-system", "glm4"],
)
def test_rollout_turns_and_continuations_rebuild_the_rendering(chat_template: str) -> None:
    """Prompt + sampled turns + continuations = the rendering, as the rollout loop builds it."""
    tokenizer = build_char_tokenizer(
        (*GLM4_SPECIALS, *get_chat_format("chatml").special_tokens), "<|im_end|>", chat_template
    )
    renderer = Renderer(tokenizer)
    conversation = TOOL_CONVERSATION[:4]  # user, call, tool result, answer
    full = renderer.render(conversation)
    (call_start, call_end), (answer_start, answer_end) = sampled_runs(full.is_sampled)
    builder = TrajectoryBuilder(renderer.render(conversation[:1], add_generation_prompt=True))
    builder.add_sampled(
        full.token_ids[call_start:call_end].tolist(), [0.0] * (call_end - call_start)
    )
    builder.add_inserted(renderer.continuation(conversation[:2], conversation[2:3]))
    answer = full.token_ids[answer_start:answer_end].tolist()
    builder.add_sampled(answer, [0.0] * len(answer))
    trajectory = builder.build()
    n = len(trajectory)
    assert trajectory.token_ids.tolist() == full.token_ids[:n].tolist()
    assert torch.equal(trajectory.is_sampled, full.is_sampled[:n])
    assert not full.is_sampled[n:].any()


def test_a_template_that_rewrites_earlier_messages_is_a_clear_error() -> None:
    tokenizer = build_tokenizer("char")
    tokenizer.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable"):
        Renderer(tokenizer)


def test_a_tokenizer_without_a_chat_template_is_a_clear_error() -> None:
    tokenizer = build_tokenizer("char")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        Renderer(tokenizer)
