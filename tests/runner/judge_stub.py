"""A tiny OpenAI-compatible chat-completions server for the endpoint judge's tests: a real
HTTP server on localhost in a thread, whose behaviour a test changes while it runs."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JudgeStub:
    """`mode`: "score" (answers `Score: <n>`, n from `score_of(user message)`), "garbage" (a
    reply without a score), "not_json", "error500", "error400", "slow" (sleeps `delay_s`),
    "flaky" (every third request a 500, the others scored)."""

    def __init__(self) -> None:
        self.mode = "score"
        self.delay_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests.append(
                        {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
                    )
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    status, payload = stub._answer(body)
                finally:
                    # Out of flight before the reply leaves: once the client has it, its next
                    # request may arrive before this thread would get past the send.
                    with stub._lock:
                        stub.in_flight -= 1
                stub._send(self, status, payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @staticmethod
    def score_of(message: str) -> str:
        return "10" if "Answer: 42" in message else "2"

    def _answer(self, body: dict[str, Any]) -> tuple[int, bytes]:
        """The (status, payload) the current mode replies to `body`."""
        mode = self.mode
        if mode == "flaky":
            mode = "error500" if len(self.requests) % 3 == 0 else "score"
        if mode == "slow":
            time.sleep(self.delay_s)
            mode = "score"
        if mode in ("error500", "error400"):
            return int(mode[-3:]), b'{"error": "boom"}'
        if mode == "not_json":
            return 200, b"<html>proxy error</html>"
        message = body["messages"][-1]["content"]
        text = (
            "I cannot grade this."
            if mode == "garbage"
            else f"Fine.\nScore: {self.score_of(message)}"
        )
        reply = {"choices": [{"message": {"role": "assistant", "content": text}}]}
        return 200, json.dumps(reply).encode()

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
