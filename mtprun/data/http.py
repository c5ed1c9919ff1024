"""POST with retries until a deadline: what the endpoint judge and the search task's retrieval
server share (each wraps the failure in its own error)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # worth another attempt
BACKOFF_S = 0.5  # before retry k: BACKOFF_S * 2**k, never past the deadline


class PostFailed(Exception):
    """Every attempt failed, or an answer no retry would change (an HTTP status outside
    RETRY_STATUS); `str()` says each attempt's failure. `attempts` is 0 when the deadline had
    passed before the first."""

    def __init__(self, failures: list[str], final: bool = False) -> None:
        self.failures = failures
        self.attempts = len(failures)
        self.final = final  # stopped by a status no retry changes
        super().__init__("; ".join(failures) or "no time left before the deadline")


def post(url: str, body: bytes, headers: dict[str, str], retries: int, deadline: float) -> bytes:
    """The response body of POSTing `body` to `url`, trying up to `retries` more times on a
    connection failure, a timeout or a status in RETRY_STATUS, all before `deadline`
    (time.monotonic()); PostFailed otherwise."""
    failures: list[str] = []
    for attempt in range(retries + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        request = urllib.request.Request(url, body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=left) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            failure = f"HTTP {err.code} from {url}: {detail}"
            if err.code not in RETRY_STATUS:
                raise PostFailed([failure], final=True) from None
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            failure = f"{url}: {getattr(err, 'reason', err)}"
        failures.append(failure)
        if attempt < retries:
            time.sleep(max(0.0, min(BACKOFF_S * 2**attempt, deadline - time.monotonic())))
    raise PostFailed(failures)
