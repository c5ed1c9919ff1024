"""RL turns through the renderer: a generated turn read back from its token ids (reasoning,
answer, tool calls; `renderers`' parser for a model family, a leading `<think>` block for
mtprun's own templates), the next turn's context built token-in, token-out (the family's
`bridge_to_next_turn`, never a re-rendering of history), and the reward's view of a turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtprun.data.messages import Message, ToolCall
from mtprun.data.render import ROLE_IDS, Renderer, folder_renderer
from mtprun.data.rewards import RewardInput
from mtprun.data.tasks import Prompt, get_task
from mtprun.data.tasks.calculator import CalculatorEnvironment
from mtprun.data.tokenizer import build_char_tokenizer
from mtprun.data.trajectory import TrajectoryBuilder, expert_rollout

from .qwen3_folder import QWEN3_SPECIALS, write_qwen3_folder

QUESTION = Message("user", "What is 5*5?")
CALL = ToolCall("calculator", {"expression": "5*5"})
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*5"}}\n</tool_call>'
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Integer arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return folder_renderer(write_qwen3_folder(tmp_path_factory.mktemp("qwen3")))


def _ids(renderer: Renderer, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def _turn(renderer: Renderer, text: str) -> list[int]:
    """`text` as a turn the engine generated: its ids, then the template's stop token."""
    return [*_ids(renderer, text), renderer.stop_token_ids[0]]


# ---- reading a generated turn back ---------------------------------------------------------


def test_own_templates_take_a_leading_think_block_as_the_reasoning(renderer: Renderer) -> None:
    turn = _turn(renderer, "<think>\nfive fives\n</think>\n\n25")
    assert renderer.parse_turn(turn) == Message("assistant", "25", (), "five fives")
    assert renderer.turn_text(turn) == "<think>\nfive fives\n</think>\n\n25"
    # Without a block, as before: all content.
    assert renderer.parse_turn(_turn(renderer, "25")) == Message("assistant", "25")


def test_own_templates_read_tool_calls_after_the_reasoning_only(renderer: Renderer) -> None:
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"5*5"}}</tool_call>'
    parsed = renderer.parse_turn(_turn(renderer, f"<think>maybe {call}?</think>{call}"))
    assert parsed.tool_calls == (CALL,)
    assert parsed.reasoning_content == f"maybe {call}?"
    # A call drafted inside the thought is no call.
    thought_only = renderer.parse_turn(_turn(renderer, f"<think>maybe {call}?</think>no"))
    assert thought_only == Message("assistant", "no", (), f"maybe {call}?")


def test_an_unclosed_or_prompt_opened_think_block(renderer: Renderer) -> None:
    cut_off = renderer.parse_turn(_ids(renderer, "<think>\nstill thinking"))
    assert cut_off == Message("assistant", "", (), "still thinking")
    # The generation prompt printed `<think>`: the turn starts inside the block.
    prompt = _ids(renderer, "What is 5*5?\n<think>\n")
    opened = renderer.parse_turn(_turn(renderer, "five fives\n</think>\n\n25"), prompt)
    assert opened == Message("assistant", "25", (), "five fives")
    assert renderer.parse_turn(_turn(renderer, "25 </think>"), _ids(renderer, "Q")).content == (
        "25 </think>"
    )


def test_a_family_turn_is_read_by_its_renderers_parser(qwen3: Renderer) -> None:
    prompt = qwen3.render((QUESTION,), add_generation_prompt=True, tools=[CALCULATOR])
    turn = _ids(qwen3, f"<think>\nuse the tool\n</think>\n\n{CALL_TEXT}<|im_end|>")
    parsed = qwen3.parse_turn(turn, prompt.token_ids.tolist(), [CALCULATOR])
    assert parsed == Message("assistant", "", (CALL,), "use the tool")
    assert qwen3.turn_text(turn) == f"<think>\nuse the tool\n</think>\n\n{CALL_TEXT}"
    # A malformed call stays content, so the reward sees what the model wrote.
    broken = qwen3.parse_turn(_ids(qwen3, "<tool_call>\n{broken\n</tool_call><|im_end|>"))
    assert broken.tool_calls == () and "{broken" in broken.content


def test_a_prompt_that_opens_reasoning_is_read_with_the_prompt(tmp_path: Path) -> None:
    no_thinking = folder_renderer(
        write_qwen3_folder(tmp_path), {"name": "qwen3", "enable_thinking": False}
    )
    prompt = no_thinking.render((QUESTION,), add_generation_prompt=True).token_ids.tolist()
    assert no_thinking.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")
    parsed = no_thinking.parse_turn(_ids(no_thinking, "25<|im_end|>"), prompt)
    assert parsed == Message("assistant", "25")


def test_the_reward_gets_the_answer_without_the_think_block(qwen3: Renderer) -> None:
    turn = _ids(qwen3, "<think>\n5*5 is 25.\n</think>\n\n25<|im_end|>")
    prompt = Prompt((QUESTION,), "25")
    message = qwen3.parse_turn(turn)
    episode = RewardInput.of(prompt, (QUESTION, message), qwen3.turn_text(turn))
    assert (episode.completion, episode.reasoning) == ("25", "5*5 is 25.")
    assert episode.raw_completion == "<think>\n5*5 is 25.\n</think>\n\n25"


# ---- token-in, token-out -------------------------------------------------------------------


def test_a_tool_answer_is_bridged_onto_the_sampled_tokens(qwen3: Renderer) -> None:
    tools = [CALCULATOR]
    prompt = qwen3.render((QUESTION,), add_generation_prompt=True, tools=tools).token_ids.tolist()
    turn = _ids(qwen3, f"<think>\nuse it\n</think>\n\n{CALL_TEXT}<|im_end|>")
    history = (QUESTION, qwen3.parse_turn(turn, prompt, tools))
    tool = Message("tool", "25")
    inserted = qwen3.next_turn(prompt, turn, history, [tool], tools)
    # Exactly what the family's bridge appends to the prompt and the sampled turn.
    bridged = qwen3.model_template.renderer.bridge_to_next_turn(
        prompt, turn, [tool.to_dict()], tools=tools
    )
    assert bridged.token_ids == prompt + turn + inserted.token_ids.tolist()
    assert qwen3.tokenizer.decode(inserted.token_ids) == (
        "\n<|im_start|>user\n<tool_response>\n25\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not inserted.is_sampled.any()
    roles = inserted.role_names()
    assert roles[0] == "assistant" and roles[-1] == "assistant"  # separator, generation prompt
    tool_message = "<|im_start|>user\n<tool_response>\n25\n</tool_response><|im_end|>\n"
    assert (inserted.roles == ROLE_IDS["tool"]).sum() == len(_ids(qwen3, tool_message))


def test_a_new_user_query_keeps_the_sampled_reasoning_in_the_context(qwen3: Renderer) -> None:
    """Qwen3's template drops earlier turns' reasoning once a new user query follows, and its
    bridge declines there; the episode still goes on from the tokens the model sampled."""
    builder = TrajectoryBuilder(qwen3.render((QUESTION,), add_generation_prompt=True))
    prompt = builder.token_ids()
    turn = _ids(qwen3, "<think>\n5*5 is 25.\n</think>\n\n25<|im_end|>")
    builder.add_sampled(turn, [-0.5] * len(turn))
    history = (QUESTION, qwen3.parse_turn(turn, prompt))
    follow_up = Message("user", "And 6*6?")
    assert qwen3.model_template.bridge(prompt, turn, [follow_up]) is None
    inserted = qwen3.next_turn(prompt, turn, history, [follow_up])
    builder.add_inserted(inserted)
    context = qwen3.tokenizer.decode(builder.token_ids())
    assert context.endswith(
        "<|im_start|>assistant\n<think>\n5*5 is 25.\n</think>\n\n25<|im_end|>\n"
        "<|im_start|>user\nAnd 6*6?<|im_end|>\n<|im_start|>assistant\n"
    )
    # A re-rendering of the conversation would have rewritten the sampled turn.
    rerendered = qwen3.render((*history, follow_up), add_generation_prompt=True)
    assert "5*5 is 25." not in qwen3.tokenizer.decode(rerendered.token_ids)
    trajectory = builder.build()
    assert trajectory.is_sampled.sum() == len(turn)
    assert torch.equal(trajectory.logprobs[trajectory.is_sampled], torch.full((len(turn),), -0.5))


def test_a_turn_cut_off_without_its_stop_is_closed_by_inserted_tokens(qwen3: Renderer) -> None:
    prompt = qwen3.render((QUESTION,), add_generation_prompt=True).token_ids.tolist()
    turn = _ids(qwen3, f"<think>\nok\n</think>\n\n{CALL_TEXT}")  # no <|im_end|>
    history = (QUESTION, qwen3.parse_turn(turn, prompt))
    inserted = qwen3.next_turn(prompt, turn, history, [Message("tool", "25")])
    assert qwen3.tokenizer.decode(inserted.token_ids[:2]) == "<|im_end|>\n"
    assert not inserted.is_sampled.any()


class ToolCalculator(CalculatorEnvironment):
    tools = (CALCULATOR,)


def test_an_episode_with_tools_is_the_template_rendering_token_for_token(qwen3: Renderer) -> None:
    task = get_task("calculator_tool")
    prompt = task.prompts(1, seed=3)[0]
    trajectory, conversation, _ = expert_rollout(
        task, prompt, qwen3, max_turns=4, environment=ToolCalculator
    )
    assert [m.role for m in conversation] == ["user", "assistant", "tool", "assistant"]
    text = qwen3.tokenizer.apply_chat_template(
        [m.to_dict() for m in conversation], tools=[CALCULATOR], tokenize=False
    )
    want = _ids(qwen3, text)
    assert trajectory.token_ids.tolist() == want[: len(trajectory)]
    assert qwen3.tokenizer.decode(want[len(trajectory) :]) == "\n"
    sampled = qwen3.tokenizer.decode(trajectory.token_ids[trajectory.is_sampled])
    assert sampled == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
        f'"{prompt.messages[0].content[8:-1]}"}}}}\n</tool_call><|im_end|>'
        f"<think>\n\n</think>\n\n{prompt.answer}<|im_end|>"
    )
    header = trajectory.roles[: len(_ids(qwen3, "<|im_start|>system\n# Tools"))]
    assert (header == ROLE_IDS["system"]).all()


@pytest.mark.parametrize(
    ("history", "new", "completion", "error"),
    [
        ((QUESTION,), (Message("tool", "25"),), [1], "history must end with the assistant"),
        ((QUESTION, Message("assistant", "x")), (), [1], "new_messages must be non-empty"),
        (
            (QUESTION, Message("assistant", "x")),
            (Message("assistant", "y"),),
            [1],
            "hold no assistant message",
        ),
        ((QUESTION, Message("assistant", "x")), (Message("tool", "25"),), [], "has no tokens"),
    ],
)
def test_next_turn_refuses_what_is_no_next_turn(
    qwen3: Renderer, renderer: Renderer, history, new, completion, error
) -> None:
    for r in (qwen3, renderer):
        with pytest.raises(ValueError, match=error):
            r.next_turn([1, 2], completion, history, new)


def test_a_folders_own_template_splits_the_reasoning_too(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    build_char_tokenizer(QWEN3_SPECIALS, "<|im_end|>", template).save_pretrained(tmp_path)
    own = folder_renderer(tmp_path)
    assert own.family is None and own.model_template is not None
    turn = _ids(own, "<think>\nplan\n</think>\n\n25<|im_end|>")
    assert own.parse_turn(turn) == Message("assistant", "25", (), "plan")
    assert own.parse_turn(_ids(own, "25<|im_end|>")) == Message("assistant", "25")
