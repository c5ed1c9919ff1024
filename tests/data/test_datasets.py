"""Prompt and SFT datasets in every format `datasets` reads here: column mapping, bad rows
reported by row with the good ones kept, held-out split, seeded epochs, and a dataset far
larger than the memory it is read with."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtprun.data.dataset_files import DataFileError
from mtprun.data.messages import Message
from mtprun.data.prompts import ConversationDataset, PromptDataset
from mtprun.spec.data import DatasetSpec

ROWS = [{"question": f"{i}+1=", "solution": i + 1, "level": i % 3} for i in range(20)]


def _write(folder, fmt: str, rows: list[dict], name: str = "prompts"):
    table = pa.Table.from_pylist(rows)
    path = folder / f"{name}.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    elif fmt == "csv":
        table.to_pandas().to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SPEC = {"columns": {"prompt": "question", "answer": "solution"}}


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "csv", "jsonl"])
def test_every_format_maps_columns_and_keeps_the_whole_record(tmp_path, fmt) -> None:
    path = _write(tmp_path, fmt, ROWS)
    data = PromptDataset(DatasetSpec(path=str(path), **SPEC), seed=0, cache_dir=tmp_path / "c")
    assert data.errors == []
    prompts = data.stream(0, len(ROWS))
    assert sorted(p.messages[0].content for p in prompts) == sorted(r["question"] for r in ROWS)
    first = next(p for p in prompts if p.messages == (Message("user", "0+1="),))
    assert first.answer == "1"
    assert first.columns() == {"question": "0+1=", "solution": 1, "level": 0}


def test_a_folder_of_files_and_a_saved_dataset_read_as_one_table(tmp_path) -> None:
    import datasets

    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder, "parquet", ROWS[:7], "a")
    _write(folder, "parquet", ROWS[7:], "b")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    for path in (folder, saved):
        data = PromptDataset(DatasetSpec(path=str(path), **SPEC), seed=0, cache_dir=tmp_path)
        assert sorted(int(p.answer) for p in data.stream(0, 20)) == list(range(1, 21))


def test_bad_rows_are_reported_by_file_and_row_and_the_rest_kept(tmp_path, caplog) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder, "parquet", ROWS[:5], "a")
    bad = [
        {"question": "", "solution": 1, "level": 0},
        {"question": None, "solution": 2, "level": 0},
        {"question": "ok", "solution": None, "level": 0},
        {"question": "fine", "solution": 3, "level": 0},
    ]
    second = _write(folder, "parquet", bad, "b")
    data = PromptDataset(DatasetSpec(path=str(folder), **SPEC), seed=0, cache_dir=tmp_path)
    assert [str(e) for e in data.errors] == [
        f'{second}: row 0: "question" is an empty prompt',
        f'{second}: row 1: "question" is null',
        f'{second}: row 2: "solution" must be a string or a number, got null',
    ]
    assert len(data.train_rows) == 6
    assert len([r for r in caplog.records if "skipping bad record" in r.message]) == 3


def test_wrong_column_names_say_which_columns_exist(tmp_path) -> None:
    path = _write(tmp_path, "parquet", ROWS)
    with pytest.raises(DataFileError) as info:
        PromptDataset(DatasetSpec(path=str(path)), seed=0, cache_dir=tmp_path)
    assert f"{path}: no \"messages\" column (columns: 'question', " in str(info.value)
    assert "columns: {prompt: NAME} or {messages: NAME}" in str(info.value)
    spec = DatasetSpec(path=str(path), columns={"prompt": "question", "answer": "reply"})
    with pytest.raises(DataFileError, match='no "reply" column'):
        PromptDataset(spec, seed=0, cache_dir=tmp_path)


def test_heldout_rows_never_train_and_epochs_reshuffle_reproducibly(tmp_path) -> None:
    path = _write(tmp_path, "parquet", ROWS)
    spec = DatasetSpec(path=str(path), heldout=5, **SPEC)
    data = PromptDataset(spec, seed=3, cache_dir=tmp_path)
    held = {p.answer for p in data.heldout()}
    assert len(held) == 5
    first, second = data.stream(0, 15), data.stream(15, 15)  # one epoch each
    for epoch in (first, second):
        assert {p.answer for p in epoch} == {str(i) for i in range(1, 21)} - held
    assert [p.answer for p in first] != [p.answer for p in second]
    again = PromptDataset(spec, seed=3, cache_dir=tmp_path)
    assert [p.answer for p in again.stream(10, 12)] == [p.answer for p in data.stream(10, 12)]
    ordered = PromptDataset(spec.model_copy(update={"shuffle": False}), 3, tmp_path)
    assert [p.answer for p in ordered.stream(0, 3)] == sorted(
        {str(i) for i in range(1, 21)} - held, key=int
    )[:3]
    fraction = PromptDataset(spec.model_copy(update={"heldout": 0.25}), 3, tmp_path)
    assert len(fraction.heldout_rows) == 5


def test_sft_rows_from_prompt_and_answer_columns_or_conversations(tmp_path) -> None:
    path = _write(tmp_path, "parquet", ROWS[:3])
    loaded = ConversationDataset(DatasetSpec(path=str(path), **SPEC), tmp_path)
    assert loaded[0] == (Message("user", "0+1="), Message("assistant", "1"))
    conversations = [
        {"messages": json.dumps([{"role": "user", "content": "a"}, {"role": "assistant"}])},
        {"messages": "[not json"},
    ]
    csv = _write(tmp_path, "csv", conversations, "chats")
    loaded = ConversationDataset(DatasetSpec(path=str(csv)), tmp_path)
    assert list(loaded) == [(Message("user", "a"), Message("assistant", ""))]
    assert str(loaded.errors[0]).startswith(f'{csv}: row 1: "messages" is not a list of messages')


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    import datasets, pyarrow  # imported before the baseline: their own memory is not data
    from mtprun.data.prompts import PromptDataset
    from mtprun.spec.data import DatasetSpec

    def anonymous_kib():  # resident memory that is not a mapped file
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    spec = DatasetSpec(path=sys.argv[1], columns={"prompt": "question", "answer": "answer"})
    before = anonymous_kib()
    data = PromptDataset(spec, seed=0, cache_dir=sys.argv[2])  # scans every row
    total = sum(len(p.messages[0].content) for p in data.stream(0, 2000))
    print(json.dumps({"growth_kib": anonymous_kib() - before, "rows": len(data.train_rows)}))
    """
)


def test_a_dataset_far_larger_than_its_memory_budget_is_never_loaded_whole(tmp_path) -> None:
    rows, text_bytes = 40_000, 8_000  # ~320 MB of prompt text
    path = tmp_path / "big.parquet"
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for start in range(0, rows, 1000):
            questions = [f"{i:08d}" + "x" * text_bytes for i in range(start, start + 1000)]
            answers = [str(i) for i in range(start, start + 1000)]
            writer.write_table(pa.table({"question": questions, "answer": answers}))
    size_kib = path.stat().st_size // 1024
    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["rows"] == rows
    assert size_kib > 300_000
    # The rows are read from memory-mapped Arrow; what stays resident is per-row indices.
    assert result["growth_kib"] < size_kib / 8, (result, size_kib)
