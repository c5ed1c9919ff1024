from __future__ import annotations

import json
import logging
import re

import pytest

from mtprun.data.dataset_files import DataFileError
from mtprun.data.messages import Message, ToolCall
from mtprun.data.prompts import ConversationDataset
from mtprun.data.tasks import get_task
from mtprun.spec.data import DatasetSpec

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
BAD_LINES = {
    "unknown role": (
        {"messages": [{"role": "bot", "content": "x"}]},
        r"message 0: unknown role 'bot'",
    ),
    "empty conversation": ({"messages": []}, "empty conversation"),
    "non-string content": (
        {"messages": [{"role": "user", "content": 7}]},
        "message 0: content must be a string, got int",
    ),
    "not json": ('{"messages": [', "not valid JSON"),
    "no messages key": ({"turns": []}, 'no "messages" column'),
    "not an object": ([1, 2], "a record is a JSON object, got list"),
    "tool call arguments": (
        {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1"}]}]},
        "tool-call arguments are not JSON",
    ),
}


def read_conversations(path):
    return ConversationDataset(DatasetSpec(path=str(path)))


def write_lines(path, records) -> None:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")


def test_bad_records_name_file_and_line_and_the_rest_is_kept(tmp_path, caplog) -> None:
    path = tmp_path / "sft.jsonl"
    records, expected_errors = [], []
    for record, reason in BAD_LINES.values():
        records += [GOOD, record]
        expected_errors.append((len(records), reason))
    records.append(GOOD)
    write_lines(path, records)

    with caplog.at_level(logging.WARNING, logger="mtprun.data.dataset_files"):
        loaded = read_conversations(path)

    assert len(loaded) == len(BAD_LINES) + 1
    assert all(c == (Message("user", "hi"), Message("assistant", "yo")) for c in loaded)
    assert [e.line for e in loaded.errors] == [line for line, _ in expected_errors]
    for error, (line, reason) in zip(loaded.errors, expected_errors, strict=True):
        assert str(error).startswith(f"{path}:{line}: ")
        assert re.search(reason, str(error)), str(error)
    assert len(caplog.records) == len(BAD_LINES)


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"messages": 3}\n')
    loaded = read_conversations(path)
    assert len(loaded) == 1
    assert [str(e) for e in loaded.errors] == [f'{path}:3: "messages" must be a list, got int']


def test_a_file_without_good_records_lists_every_bad_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    write_lines(path, ["nope", {"messages": []}])
    with pytest.raises(DataFileError) as info:
        read_conversations(path)
    message = str(info.value)
    assert f"no usable record in {path}" in message
    assert f"{path}:1: not valid JSON" in message and f"{path}:2: empty conversation" in message


def test_an_empty_file_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(
        DataFileError, match=r"no usable record in .*empty.jsonl: \(it has no rows\)"
    ):
        read_conversations(path)


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DataFileError, match=r"cannot read data file .*missing.jsonl"):
        read_conversations(tmp_path / "missing.jsonl")


def test_tool_calls_parse_in_openai_and_flat_form(tmp_path) -> None:
    path = tmp_path / "tools.jsonl"
    openai = {"type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    flat = {"name": "calc", "arguments": {"x": 1}}
    write_lines(
        path,
        [
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [c]}]}
            for c in (openai, flat)
        ],
    )
    expected = (Message("assistant", "", (ToolCall("calc", {"x": 1}),)),)
    assert list(read_conversations(path)) == [expected, expected]


def test_prompt_files_feed_a_task_with_or_without_an_answer(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    prompt = {"messages": [{"role": "user", "content": "2+2="}], "answer": 4, "level": 1}
    bad_answer = {"messages": [{"role": "user", "content": "x"}], "answer": [4]}
    write_lines(path, [prompt, bad_answer, {"prompt": "3+3="}])
    task = get_task(str(path))
    assert [str(e) for e in task.data.errors] == [
        f'{path}:2: "answer" must be a string or a number, got list'
    ]
    drawn = {p.messages[0].content: p for p in task.prompts(6, seed=0)}
    assert drawn["2+2="].answer == "4" and drawn["2+2="].columns()["level"] == 1
    assert drawn["3+3="].answer is None and drawn["3+3="].messages == (Message("user", "3+3="),)
