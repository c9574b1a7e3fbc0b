"""HTTP client of the server's ingest API (knows nothing of torch or of threads).

    POST {server}/api/v1/runs                  RunCreate JSON, gzip, idempotent on run_id
    POST {server}/api/v1/runs/{run_id}/events  EventBatch JSON, gzip; -> {"accepted", "duplicates"}

Failures are sorted into three kinds, because the shipper treats them differently:

* `ServerUnavailable`: connection refused, timeout, 5xx, 429 — worth retrying later; the
  events wait in the spool meanwhile. `RunNotFound` (404 for a run's events: a server
  restarted on an empty database) is one of them: create the run again, then retry. A
  server that sheds load (503/429) or whose database is down (503) or full (507) says when
  to come back in `Retry-After`: the error carries it (`retry_after_s`).
* `PayloadTooLarge` (413): split the batch and send the halves.
* `ServerRejected`: any other 4xx (bad token, schema mismatch) — retrying the same bytes
  cannot help; the message names the status and the server's detail.

One POST is tried `attempts` times with exponential backoff and full jitter between
(tenacity), so a blip costs a fraction of a second, not a spool round trip. A Retry-After
is honoured: the next try waits at least that long, plus up to half of it again (jitter,
so that the agents a busy server turned away together do not return together). When the
server asks for a longer wait than `max_retry_after_s` (default `max_wait_s`), the client
does not sit in it: it raises
at once, and the caller (the shipper) keeps the events in its spool and comes back after
the wait.

The requests go through urllib3, one keep-alive connection per client (a connection the
server closed while idle is noticed before the next request and opened again): a POST costs
the shipper thread, which shares the GIL with training, about half of httpx's CPU (its
client, auth, redirect and transport layers run for every request; measured on a loopback
server). A server the environment routes through a proxy (`HTTP_PROXY`, `HTTPS_PROXY`,
`NO_PROXY`, as httpx read them) is reached through it.
"""

from __future__ import annotations

import email.utils
import json
import random
import time
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import tenacity

# urllib3 adds two warning filters of its own when first imported: the script's filters
# are the script's (the agent leaves them as it found them).
with warnings.catch_warnings():
    import urllib3

from zerowatch.agent import codec

from zerowatch import __version__


class IngestError(Exception):
    """Base of the client's errors."""


class ServerUnavailable(IngestError):
    """The server cannot take the request now; try again later (`retry_after_s`: when the
    server said, from its Retry-After header)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RunNotFound(ServerUnavailable):
    """404 for a run's events: the run is not (or no longer) there; create it and retry."""


class PayloadTooLarge(IngestError):
    """413: the batch is over the server's size limit."""


class ServerRejected(IngestError):
    """A 4xx other than 404/413/429: the request itself is refused."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer to one request."""

    status_code: int
    #: The Retry-After header as sent; None without one.
    retry_after: str | None
    body: bytes

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return json.loads(self.body)


def _detail(answer: Answer) -> str:
    try:
        body = answer.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])[:500]
    except ValueError:
        pass
    return answer.body[:500].decode("utf-8", "replace")


def retry_after_s(value: str | None) -> float | None:
    """Seconds of a Retry-After header (delay-seconds or an HTTP date); None when absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def honoured_wait_s(retry_after: float) -> float:
    """How long to wait when told `Retry-After: retry_after`: at least that, plus up to half
    of it again, so that clients turned away together spread out."""
    return retry_after * random.uniform(1.0, 1.5)


def _check(answer: Answer, url: str, *, missing_run_is_transient: bool) -> None:
    code = answer.status_code
    if code < 400:
        return
    if code == 404 and missing_run_is_transient:
        raise RunNotFound(f"{code} from {url}: {_detail(answer)}")
    if code >= 500 or code == 429:
        raise ServerUnavailable(
            f"{code} from {url}: {_detail(answer)}",
            retry_after_s=retry_after_s(answer.retry_after),
        )
    if code == 413:
        raise PayloadTooLarge(_detail(answer))
    raise ServerRejected(code, _detail(answer))


def _proxy_for(server: str) -> str | None:
    """The proxy the environment routes `server` through (`HTTP_PROXY` / `HTTPS_PROXY` /
    `ALL_PROXY`, less `NO_PROXY`), or None."""
    parts = urlsplit(server)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.netloc):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get(parts.scheme) or proxies.get("all") or None


def _pool(server: str, timeout_s: float) -> tuple[Any, str]:
    """The connection pool to `server` (one connection, kept alive), and what to put
    before a request's path: the server's own path prefix, or for a proxy the whole URL."""
    common: dict[str, Any] = {
        "retries": False,  # tenacity retries, with the Retry-After rules above
        "timeout": urllib3.Timeout(connect=timeout_s, read=timeout_s),
        "maxsize": 1,
    }
    proxy = _proxy_for(server)
    if proxy is not None:
        return urllib3.ProxyManager(proxy, num_pools=1, **common), server
    return urllib3.connection_from_url(server, **common), urlsplit(server).path


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop retrying once the client's deadline (set at close) has passed."""

    def __init__(self, client: IngestClient) -> None:
        self._client = client

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._client._past_deadline()


class _StopWhenToldToWaitLong(tenacity.stop.stop_base):
    """Stop when the server asked for a wait longer than the client's `max_wait_s`: the
    caller keeps the request (the shipper: in its spool) and comes back after it."""

    def __init__(self, max_wait_s: float) -> None:
        self._max_wait_s = max_wait_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        wait = getattr(exc, "retry_after_s", None)
        return wait is not None and wait > self._max_wait_s


class _WaitHonouringRetryAfter(tenacity.wait.wait_base):
    """Exponential backoff with full jitter, or the server's Retry-After (jittered) when it
    gave one."""

    def __init__(self, max_wait_s: float) -> None:
        self._backoff = tenacity.wait_random_exponential(multiplier=0.1, max=max_wait_s)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        wait = getattr(exc, "retry_after_s", None)
        if wait is not None:
            return honoured_wait_s(wait)
        return float(self._backoff(retry_state))


_EVENTS_HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
_JSON_HEADERS = {"Content-Type": "application/json"}


class IngestClient:
    """Blocking client of one server; used from the shipper thread and by `upload`."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        timeout_s: float = 5.0,
        attempts: int = 3,
        max_wait_s: float = 2.0,
        max_retry_after_s: float | None = None,
    ) -> None:
        if not server.startswith(("http://", "https://")):
            raise ValueError(f"server: expected an http:// or https:// URL, got {server!r}")
        headers = {"User-Agent": f"zerowatch-agent/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.server = server.rstrip("/")
        self.timeout_s = timeout_s
        #: time.monotonic() after which no request starts and none outlasts it (at close).
        self.deadline: float | None = None
        self._headers = headers
        self._http, self._prefix = _pool(self.server, timeout_s)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max(attempts, 1))
            | _StopAtDeadline(self)
            | _StopWhenToldToWaitLong(
                max_wait_s if max_retry_after_s is None else max_retry_after_s
            ),
            wait=_WaitHonouringRetryAfter(max_wait_s),
            retry=tenacity.retry_if_exception_type(ServerUnavailable)
            & tenacity.retry_if_not_exception_type(RunNotFound),
            reraise=True,
        )

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _post(
        self, path: str, *, missing_run_is_transient: bool, content: bytes, headers: dict[str, str]
    ) -> Answer:
        timeout = self.timeout_s
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise ServerUnavailable("out of time (closing)")
        url = self._prefix + path
        try:
            resp = self._http.urlopen(
                "POST", url, body=content, headers={**self._headers, **headers},
                timeout=urllib3.Timeout(connect=timeout, read=timeout),
                retries=False, redirect=False, decode_content=False,
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as e:
            # Refused, timed out, closed mid-answer: the server is not there for now.
            raise ServerUnavailable(f"{type(e).__name__}: {e}") from e
        answer = Answer(resp.status, resp.headers.get("retry-after"), resp.data)
        _check(answer, self.server + path, missing_run_is_transient=missing_run_is_transient)
        return answer

    def create_run(self, run_create: bytes) -> None:
        """POST the RunCreate JSON, gzip-compressed as event batches are (idempotent on
        run_id)."""
        self._retrying(
            self._post,
            "/api/v1/runs",
            missing_run_is_transient=False,
            content=codec.gzip(run_create),
            headers=_EVENTS_HEADERS,
        )

    def post_events(self, run_id: str, gz_body: bytes, *, retry: bool = True) -> IngestResult:
        """POST one gzip-compressed EventBatch body; returns what the server stored."""
        kw: dict[str, Any] = {
            "missing_run_is_transient": True,
            "content": gz_body,
            "headers": _EVENTS_HEADERS,
        }
        path = f"/api/v1/runs/{run_id}/events"
        answer = self._retrying(self._post, path, **kw) if retry else self._post(path, **kw)
        try:
            body = answer.json()
            return IngestResult(int(body.get("accepted", 0)), int(body.get("duplicates", 0)))
        except (ValueError, AttributeError, TypeError):
            return IngestResult(0, 0)

    def post_heartbeat(self, run_id: str, body: bytes) -> None:
        """POST one HeartbeatBatch JSON body, once (a lost heartbeat is replaced by the
        next: no retries, no spool)."""
        self._post(f"/api/v1/runs/{run_id}/heartbeats", missing_run_is_transient=True,
                   content=body, headers=_JSON_HEADERS)  # fmt: skip

    def close(self) -> None:
        if isinstance(self._http, urllib3.PoolManager):
            self._http.clear()
        else:
            self._http.close()


__all__ = [
    "Answer",
    "IngestClient",
    "IngestError",
    "IngestResult",
    "PayloadTooLarge",
    "RunNotFound",
    "ServerRejected",
    "ServerUnavailable",
    "honoured_wait_s",
    "retry_after_s",
]
