"""Tool specs: read from a dataset row's `tools` column (or an environment's `tools`),
printed by the chat template when it renders the prompt or the SFT conversation (a
`renderers` family and a model folder's own template alike), and every bad spec, and a
template that cannot print tools, answered with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtprun.data.environment import episode_tools
from mtprun.data.mask import token_mask
from mtprun.data.messages import ConversationError, Message, Prompt, ToolCall, parse_tools
from mtprun.data.prompts import ConversationDataset, PromptDataset
from mtprun.data.render import ROLE_IDS, Renderer, folder_renderer
from mtprun.data.sft import PackedSft, training_sequences
from mtprun.data.tokenizer import build_char_tokenizer
from mtprun.spec.data import DatasetSpec

from .qwen3_folder import QWEN3_SPECIALS, write_qwen3_folder

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Integer arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
FLAT = {"name": "clock", "description": "The time.", "parameters": {"type": "object"}}
QUESTION = Message("user", "What is 5*5?")
CONVERSATION = (
    QUESTION,
    Message("assistant", "", (ToolCall("calculator", {"expression": "5*5"}),), "Use it."),
    Message("tool", "25"),
    Message("assistant", "25", reasoning_content="It said 25."),
)

# A chat template (not a `renderers` family's) that prints the tools in a system header.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_TOOLS_TEMPLATE = TOOLS_TEMPLATE.split("{% endif %}", 1)[1]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return folder_renderer(write_qwen3_folder(tmp_path_factory.mktemp("qwen3")))


def _own_template_folder(path: Path, template: str) -> Renderer:
    build_char_tokenizer(QWEN3_SPECIALS, "<|im_end|>", template).save_pretrained(path)
    return folder_renderer(path)


def _template_ids(renderer: Renderer, messages, tools, **kwargs) -> list[int]:
    text = renderer.tokenizer.apply_chat_template(
        [m.to_dict() for m in messages], tools=tools, tokenize=False, **kwargs
    )
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def test_tool_specs_are_read_as_given() -> None:
    assert parse_tools([CALCULATOR, FLAT]) == (CALCULATOR, FLAT)
    assert parse_tools(json.dumps([CALCULATOR])) == (CALCULATOR,)  # csv: JSON text
    assert parse_tools(None) == parse_tools("") == parse_tools([]) == ()


@pytest.mark.parametrize(
    ("tools", "error"),
    [
        ({"name": "x"}, "tools must be a list of tool specs, got dict"),
        ("[{", "tools: not a JSON list of tool specs"),
        (["calculator"], r"tools\[0\]: a tool spec is an object, got str"),
        ([{"description": "no name"}], r'tools\[0\]: a tool spec needs a string "name"'),
        ([FLAT, {"type": "function", "function": {"name": ""}}], r"tools\[1\]: .* needs"),
        ([{"type": "retrieval", "function": FLAT}], r'only "function" tools'),
        ([{"type": "function", "function": "clock"}], r'"function" must be an object'),
        ([{"name": "x", "parameters": []}], r"tools\[0\] \(x\): parameters must be a JSON-schema"),
    ],
)
def test_a_bad_tool_spec_is_a_clear_error(tools, error) -> None:
    with pytest.raises(ConversationError, match=error):
        parse_tools(tools)


def test_a_family_prints_the_tools_of_a_prompt_and_of_an_sft_conversation(qwen3) -> None:
    prompt = qwen3.render((QUESTION,), add_generation_prompt=True, tools=[CALCULATOR, FLAT])
    want = _template_ids(qwen3, (QUESTION,), [CALCULATOR, FLAT], add_generation_prompt=True)
    assert prompt.token_ids.tolist() == want
    header = len(qwen3.tokenizer.encode(qwen3.tokenizer.decode(want).split("<|im_end|>")[0]))
    assert (prompt.roles[:header] == ROLE_IDS["system"]).all() and not prompt.is_sampled.any()
    (sequence,) = qwen3.render_training(CONVERSATION, tools=[CALCULATOR])
    assert sequence.token_ids.tolist() == _template_ids(qwen3, CONVERSATION, [CALCULATOR])
    sampled = qwen3.tokenizer.decode(sequence.token_ids[sequence.is_sampled])
    assert '"description"' not in sampled and sampled.endswith("25<|im_end|>")


def test_a_folders_own_template_prints_the_tools(tmp_path) -> None:
    renderer = _own_template_folder(tmp_path, TOOLS_TEMPLATE)
    assert renderer.family is None
    messages = (Message("user", "hi"), Message("assistant", "hello"))
    sequence = renderer.render(messages, tools=[CALCULATOR])
    assert sequence.token_ids.tolist() == _template_ids(renderer, messages, [CALCULATOR])
    header = len(renderer.tokenizer.encode(f"<|im_start|>system\nTools:\n{json.dumps(CALCULATOR)}"))
    assert (sequence.roles[:header] == ROLE_IDS["system"]).all()
    sampled = renderer.tokenizer.decode(sequence.token_ids[sequence.is_sampled])
    assert sampled == "hello<|im_end|>"
    # Without tools the template renders as before.
    bare = renderer.render(messages)
    assert bare.token_ids.tolist() == _template_ids(renderer, messages, None)


def test_a_template_that_prints_no_tools_refuses_a_conversation_with_some(
    tmp_path, renderer: Renderer
) -> None:
    own = _own_template_folder(tmp_path, NO_TOOLS_TEMPLATE)
    with pytest.raises(ValueError, match="prints no tool specs: a prompt with `tools`"):
        own.render((QUESTION,), add_generation_prompt=True, tools=[CALCULATOR])
    assert len(own.render((QUESTION,), add_generation_prompt=True))  # no tools: fine
    with pytest.raises(ValueError, match=r"chat template '\w+' prints no tool specs.* has 1"):
        renderer.render((QUESTION,), tools=[CALCULATOR])


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_dataset_rows_tools_reach_the_prompt_and_bad_ones_are_bad_rows(tmp_path) -> None:
    path = _jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "What is 5*5?", "answer": "25", "tools": [CALCULATOR]},
            {"prompt": "What time is it?", "answer": "noon", "tools": json.dumps([FLAT])},
            {"prompt": "1+1", "answer": "2"},
            {"prompt": "bad", "answer": "x", "tools": [{"description": "no name"}]},
        ],
    )
    data = PromptDataset(DatasetSpec(path=str(path), shuffle=False), 0, tmp_path / "cache")
    (error,) = data.errors
    assert str(error) == f'{path}:4: tools[0]: a tool spec needs a string "name" (as ' + (
        '{"type": "function", "function": {"name", "description", "parameters"}} or {"name", ...})'
    )
    prompts = data.stream(0, 3)
    assert [p.tools for p in prompts] == [(CALCULATOR,), (FLAT,), ()]
    assert prompts[0].columns()["tools"] == [CALCULATOR]  # the reward sees the column too


def test_sft_rows_train_with_their_tools_printed(tmp_path, qwen3) -> None:
    rows = [
        {"messages": [m.to_dict() for m in CONVERSATION], "tools": [CALCULATOR]},
        {"messages": [QUESTION.to_dict(), {"role": "assistant", "content": "25"}]},
    ]
    data = ConversationDataset(DatasetSpec(path=str(_jsonl(tmp_path / "sft.jsonl", rows))))
    assert data.example(0) == (CONVERSATION, (CALCULATOR,))
    (with_tools,) = training_sequences(data, 0, qwen3)
    assert with_tools.token_ids.tolist() == _template_ids(qwen3, CONVERSATION, [CALCULATOR])
    (without,) = training_sequences(data, 1, qwen3)
    assert "# Tools" not in qwen3.tokenizer.decode(without.token_ids)
    packed = PackedSft(data, qwen3, "sampled", packing_length=4096)
    (batch,) = list(packed)
    assert int(batch.loss_mask.sum()) == int(
        token_mask(with_tools, "sampled").sum() + token_mask(without, "sampled").sum()
    )


class DeclaresTools:
    tools = (FLAT,)

    def reset(self, prompt):
        return prompt.messages

    def step(self, messages):
        raise AssertionError("not stepped here")


class DeclaresBadTools(DeclaresTools):
    tools = "clock"


def test_an_episode_prints_its_prompts_tools_else_its_environments() -> None:
    plain = Prompt((QUESTION,), "25")
    with_tools = Prompt((QUESTION,), "25", tools=(CALCULATOR,))
    assert episode_tools(DeclaresTools(), with_tools) == (CALCULATOR,)
    assert episode_tools(DeclaresTools(), plain) == (FLAT,)
    assert episode_tools(object(), plain) == ()
    with pytest.raises(ValueError, match=r"DeclaresBadTools\.tools is not a list of tool specs"):
        episode_tools(DeclaresBadTools(), plain)
