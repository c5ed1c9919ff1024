from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.style import Style
from rich.text import Text

from mtprun.cli import main
from mtprun.cli.inspect_data import TRAINED_STYLE
from mtprun.data.tokenizer import build_tokenizer

from .qwen3_folder import write_qwen3_folder

RECIPE = """\
name: inspect
seed: {seed}
model:
  tiny: {{architecture: qwen2, hidden: 64, layers: 1, heads: 1, kv_heads: 1}}
{data}
losses:
  - kind: {loss}
mask: {mask}
"""
TASK = "task: {name: calculator_tool, reward: calculator_tool, template: glm, max_turns: 2}"


def write_recipe(tmp_path: Path, data: str, loss: str = "grpo", mask: str = "sampled") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(seed=0, data=data, loss=loss, mask=mask))
    return path


def counts(output: str, role: str) -> list[tuple[int, int]]:
    """(tokens, trained) of `role` in every per-sample table."""
    return [
        (int(a), int(b))
        for a, b in re.findall(rf"^{role}\s+(\d+)\s+(\d+)", output, flags=re.MULTILINE)
    ]


def test_rl_task_shows_untrained_tool_output_and_trained_stop_tokens(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, TASK)
    mtprun = Path(sys.executable).with_name("mtprun")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FORCE_COLOR": "1", "COLUMNS": "200"}
    result = subprocess.run(
        [str(mtprun), "inspect-data", str(recipe), "-n", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plain = Text.from_ansi(result.stdout).plain
    assert "task: calculator_tool (RL, template glm" in plain
    assert plain.count("2 assistant turn(s), reward 1") == 2
    # Most tokens are the tool's, none of them trained; both turns' stop tokens are trained.
    assert [trained for _, trained in counts(plain, "tool")] == [0, 0]
    assert all(
        tool > assistant
        for (tool, _), (assistant, _) in zip(
            counts(plain, "tool"), counts(plain, "assistant"), strict=True
        )
    )
    assert [trained for _, trained in counts(plain, "stop tokens")] == [2, 2]
    fraction = re.search(r"trained fraction: ([\d.]+)%", plain)
    assert fraction and 0 < float(fraction.group(1)) < 50

    highlighted = Text.from_ansi(result.stdout)
    trained_background = Style.parse(TRAINED_STYLE).bgcolor.number
    trained = "".join(
        highlighted.plain[span.start : span.end]
        for span in highlighted.spans
        if span.style.bgcolor and span.style.bgcolor.number == trained_background
    )
    assert trained.count("<|observation|>") == 2 and trained.count("<|endoftext|>") == 2
    assert "result:" not in trained and "What is" not in trained


def test_sft_file_with_bad_records_shows_them_and_the_good_ones(tmp_path, capsys) -> None:
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    data.write_text(json.dumps(good) + "\n{oops\n" + json.dumps(good) + "\n")
    recipe = write_recipe(tmp_path, f"data: {{source: {data.name}, template: chatml}}", "ce", "all")

    assert main(["inspect-data", str(recipe), "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert f"skipped bad record {data}:2: not valid JSON" in out
    assert out.count("sample ") == 2
    assert "trained fraction: 100.0%" in out  # mask all trains every token


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ("data: {source: missing.jsonl}", "file not found"),
        ("task: {name: chess, reward: arithmetic}", "unknown built-in task 'chess'"),
        ("task: {name: arithmetic, reward: elo}", "unknown reward 'elo'"),
    ],
)
def test_invalid_sources_are_located_recipe_errors(tmp_path, capsys, data, error) -> None:
    recipe = write_recipe(tmp_path, data, "ce" if data.startswith("data") else "grpo")
    assert main(["inspect-data", str(recipe)]) == 2
    assert re.search(rf"recipe.yaml:5:\d+: {error}", capsys.readouterr().err)


def test_a_data_file_without_good_records_is_a_clear_error(tmp_path, capsys) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": []}\n')
    recipe = write_recipe(tmp_path, f"data: {{source: {data.name}}}", "ce")
    assert main(["inspect-data", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"no usable record in {data}" in err and f"{data}:1: empty conversation" in err


def inspect_folder(tmp_path: Path, data: str, capsys) -> str:
    """`inspect-data -n 1` of an SFT recipe on the model folder `tmp_path/model`: its output."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: folder\nmodel: {{path: model}}\ndata: {data}\nlosses: [{{kind: ce}}]\n"
        "mask: sampled\n"
    )
    assert main(["inspect-data", str(recipe), "-n", "1"]) == 0
    return capsys.readouterr().out


def test_model_folder_with_its_own_template_shows_exact_labels(tmp_path, capsys) -> None:
    model = tmp_path / "model"
    tokenizer = build_tokenizer("glm")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(model)
    out = inspect_folder(tmp_path, "{source: arithmetic, template: glm}", capsys)
    # The assistant's tag is its generation prompt: every assistant token but that one trains.
    counts = re.search(r"^assistant\s+(\d+)\s+(\d+)$", out, flags=re.MULTILINE)
    assert counts is not None and int(counts[1]) == int(counts[2]) + 1, out


def test_a_qwen3_folder_with_reasoning_is_rendered_not_refused(tmp_path: Path, capsys) -> None:
    write_qwen3_folder(tmp_path / "model")
    messages = [
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "content": "12", "reasoning_content": "3*4 is 12."},
        {"role": "user", "content": "And 5*5?"},
        {"role": "assistant", "content": "25", "reasoning_content": "5*5 is 25."},
    ]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    out = inspect_folder(tmp_path, "{source: chats.jsonl}", capsys)
    assert "not prefix-stable" not in out
    # Both turns, each with its reasoning: as the model sees it when it is the newest.
    assert "5*5 is 25." in out and "3*4 is 12." in out
