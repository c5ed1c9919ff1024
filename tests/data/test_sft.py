"""SFT data as packed rows built on demand (`PackedSft`): the same rows as packing everything
at once, over-long conversations reported by file and row, and a dataset far larger than the
memory it is packed with."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtprun.data.packing import pack
from mtprun.data.prompts import ConversationDataset
from mtprun.data.render import Renderer
from mtprun.data.sft import PackedSft, load_conversations
from mtprun.data.tokenizer import build_tokenizer
from mtprun.spec.data import DataSection, DatasetSpec

PACKING = 96


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(build_tokenizer("char"))


def _dataset(tmp_path, answers: list[str]) -> ConversationDataset:
    path = tmp_path / "sft.parquet"
    rows = [{"prompt": f"{i}?", "answer": a} for i, a in enumerate(answers)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return ConversationDataset(DatasetSpec(path=str(path)), tmp_path / "cache")


def test_rows_equal_packing_every_conversation_at_once(tmp_path, renderer) -> None:
    rng = random.Random(11)
    answers = ["x" * rng.randrange(1, 60) for _ in range(50)]
    conversations = _dataset(tmp_path, answers)
    rows = PackedSft(conversations, renderer, "sampled", PACKING)
    whole = pack([renderer.render(c) for c in conversations], "sampled", PACKING)
    assert rows.conversation_count == 50 and rows.errors == []
    assert len(rows) == len(whole) > 10
    for i in (*range(len(rows)), -1):
        ours, expected = rows[i], whole[i]
        for field in ("input_ids", "targets", "loss_mask", "position_ids", "cu_seqlens"):
            assert getattr(ours, field).equal(getattr(expected, field)), (i, field)


def test_a_conversation_longer_than_a_row_is_a_bad_row(tmp_path, renderer, caplog) -> None:
    answers = ["ab", "y" * (2 * PACKING), "cd", "z" * PACKING]
    conversations = _dataset(tmp_path, answers)
    with caplog.at_level(logging.WARNING, logger="mtprun.data.sft"):
        rows = PackedSft(conversations, renderer, "sampled", PACKING)
    assert rows.conversation_count == 2
    assert [e.line for e in rows.errors] == [1, 3]
    assert str(rows.errors[0]).startswith(f"{tmp_path / 'sft.parquet'}: row 1: ")
    assert f"longer than data.packing_length={PACKING}" in str(rows.errors[0])
    assert len([r for r in caplog.records if "skipping bad record" in r.message]) == 2
    (row,) = rows
    assert int(row.cu_seqlens[-1]) == sum(len(renderer.render(conversations[i])) for i in (0, 2))


def test_a_restart_reads_the_token_counts_until_the_data_or_tokenizer_changes(
    tmp_path, renderer
) -> None:
    rng = random.Random(5)
    answers = ["x" * rng.randrange(1, 40) for _ in range(30)]
    dataset = _dataset(tmp_path, answers)

    def reopened() -> ConversationDataset:  # as a resumed run opens the same file
        return ConversationDataset(dataset.spec, tmp_path / "cache")

    cache = tmp_path / "counts"
    first = PackedSft(dataset, renderer, "sampled", PACKING, cache)
    (saved,) = cache.glob("sft-token-counts-*.npy")
    assert np.load(saved).tolist() == [len(renderer.render(c)) for c in dataset]
    # The next start packs by the saved counts: told each conversation fills a row, it
    # gives each a row of its own.
    np.save(saved, np.full(30, PACKING))
    again = PackedSft(reopened(), renderer, "sampled", PACKING, cache)
    assert len(first) < 30 and len(again) == 30
    # Another tokenizer, or other data (the file rewritten): counted again.
    other = Renderer(build_tokenizer("glm"))
    PackedSft(reopened(), other, "sampled", 4 * PACKING, cache)
    assert len(list(cache.glob("sft-token-counts-*.npy"))) == 2
    changed = _dataset(tmp_path, [*answers[:-1], "y" * 50])
    assert len(PackedSft(changed, renderer, "sampled", PACKING, cache)) < 30
    assert len(list(cache.glob("sft-token-counts-*.npy"))) == 3


def test_bad_packing_lengths_are_clear_errors(tmp_path, renderer) -> None:
    with pytest.raises(ValueError, match=r"no conversation fits data\.packing_length=4 tokens"):
        PackedSft(_dataset(tmp_path, ["abcdef", "ghijkl"]), renderer, "sampled", 4)
    examples = load_conversations(
        DataSection(source="addition", packing_length=8, num_samples=3), seed=0
    )
    too_long = r"SFT example \d+ has \d+ tokens, longer .*; raise data\.packing_length"
    with pytest.raises(ValueError, match=too_long):
        PackedSft(examples, renderer, "sampled", 8)
    with pytest.raises(IndexError, match="packed row 5 of"):
        PackedSft(examples, renderer, "sampled", PACKING)[5]


MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    import datasets, pyarrow, torch  # imported before the baseline: their memory is not data
    from mtprun.data.messages import Message
    from mtprun.data.prompts import ConversationDataset
    from mtprun.data.render import Renderer
    from mtprun.data.sft import PackedSft
    from mtprun.data.tokenizer import build_tokenizer
    from mtprun.spec.data import DatasetSpec

    def anonymous_kib():  # resident memory that is not a mapped file
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    renderer = Renderer(build_tokenizer("char"))
    renderer.render((Message("user", "1?"), Message("assistant", "2")))  # the tokenizer warm
    before = anonymous_kib()
    rows = PackedSft(
        ConversationDataset(DatasetSpec(path=sys.argv[1]), sys.argv[2]), renderer, "all", 4096
    )
    tokens = sum(int(rows[i].cu_seqlens[-1]) for i in range(0, len(rows), 97))
    print(json.dumps({"growth_kib": anonymous_kib() - before, "rows": len(rows),
                      "conversations": rows.conversation_count}))
    """
)


def test_a_dataset_far_larger_than_its_memory_budget_is_never_packed_whole(tmp_path) -> None:
    conversations, answer_bytes = 6_000, 2_000
    path = tmp_path / "big.parquet"
    schema = pa.schema([("prompt", pa.string()), ("answer", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for start in range(0, conversations, 1000):
            prompts = [f"{i:06d}?" for i in range(start, start + 1000)]
            answers = [f"{i % 10}" * answer_bytes for i in range(start, start + 1000)]
            writer.write_table(pa.table({"prompt": prompts, "answer": answers}))
    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["conversations"] == conversations and result["rows"] == conversations // 2
    # Packed whole, the token ids alone would take 8 bytes x 12 M tokens = 94 MiB; what stays
    # resident is a few integers per conversation.
    token_kib = conversations * answer_bytes * 8 // 1024
    assert result["growth_kib"] < token_kib / 8, (result, token_kib)
