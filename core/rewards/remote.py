"""The ``remote`` reward: scores from a reward server (``sagegrpo serve-reward``), so a large reward model can run
on its own GPUs while training runs elsewhere. The prompts' metadata columns travel with the videos, so a served reward
takes them as keyword arguments exactly as it would in process.

Requests go out ``batch_size`` videos at a time, halved further when a request would exceed the body limit the
server states on ``/health``, and ``concurrency`` of them at once: a server merges the requests waiting for its scoring
thread into one reward call (so the body limit does not force small reward batches), and replicas behind a load
balancer score them side by side. Connection errors, read timeouts and 5xx answers (503: the server is busy or a reward
timed out) are retried by urllib3's ``Retry`` with exponential backoff; once retries are spent the reward raises
``RewardUnavailable`` and the scorer scores those samples None (dropped from their groups) instead of stopping
training. A server that requires a token gets it from ``token_env`` (an environment variable's name) or
``token_file``; the token itself never appears in a config, a log line or an error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

from ..errors import UserError
from ..secrets import mask_uri, read_secret
from .base import Columns, RewardUnavailable, Scores, VideoBatch, join_batches, slice_columns
from .wire import CONTENT_TYPE, decode_response, encode_request

RETRIED_STATUSES = (500, 502, 503, 504)


class RemoteReward:
    """Calls ``POST {url}/score``; reports whatever dimensions the server's rewards report."""

    def __init__(
        self,
        url: str,
        timeout: float = 300.0,
        retries: int = 3,
        batch_size: int = 8,
        backoff: float = 0.5,
        token_env: str | None = None,
        token_file: str | None = None,
        concurrency: int = 1,
    ):
        if batch_size < 1 or retries < 0 or timeout <= 0 or concurrency < 1:
            raise ValueError("remote reward needs batch_size >= 1, retries >= 0, timeout > 0 and concurrency >= 1")
        self.url, self.timeout, self.retries, self.batch_size = url.rstrip("/"), timeout, retries, batch_size
        self.concurrency = concurrency
        # Scoring has no side effects, so retrying a POST is safe: allowed_methods=None retries every method.
        retry = Retry(
            total=retries,
            backoff_factor=backoff,
            status_forcelist=RETRIED_STATUSES,
            allowed_methods=None,
            raise_on_status=False,
        )
        self.session = requests.Session()
        # One pooled connection per request in flight (urllib3's pool is thread-safe; its default keeps 10).
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=max(10, concurrency))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        token = read_secret(token_env, token_file, what="remote reward token")
        if token is not None:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self._max_body: int | None = None
        self._shown_url = mask_uri(self.url)  # for messages: a URL may carry user:password

    def __call__(self, videos: VideoBatch, prompts: list[str], /, **columns: list) -> Scores:
        """``columns``: the prompts' metadata columns, sent along for the server's rewards that take them (the
        arguments before them are positional-only, so a column may be named ``self`` too)."""
        starts = range(0, len(videos), self.batch_size)
        batches = [
            (
                videos[i : i + self.batch_size],
                prompts[i : i + self.batch_size],
                slice_columns(columns, i, i + self.batch_size),
            )
            for i in starts
        ]
        if self.concurrency == 1 or len(batches) == 1:
            return join_batches([self._score(*batch) for batch in batches])
        with ThreadPoolExecutor(min(self.concurrency, len(batches)), thread_name_prefix="remote-reward") as pool:
            return join_batches(list(pool.map(lambda batch: self._score(*batch), batches)))

    def _score(self, videos: VideoBatch, prompts: list[str], columns: Columns) -> Scores:
        body = encode_request(videos, prompts, columns)
        limit = self._body_limit()
        if limit is not None and len(body) > limit:
            if len(videos) == 1:
                raise RewardUnavailable(
                    f"one video is {len(body)} bytes; reward server {self._shown_url} accepts "
                    f"{limit} (raise its --max-body-mb)"
                )
            half = len(videos) // 2
            return join_batches(
                [
                    self._score(videos[:half], prompts[:half], slice_columns(columns, 0, half)),
                    self._score(videos[half:], prompts[half:], slice_columns(columns, half, len(videos))),
                ]
            )
        return self._post(body)

    def _body_limit(self) -> int | None:
        """The server's body limit from ``/health``, asked once; None when it does not say (an older server)."""
        if self._max_body is None:
            try:
                # Outside the session: one quick try, not the POST's retries (a down server is reported there).
                response = requests.get(f"{self.url}/health", timeout=min(self.timeout, 10.0))
                self._max_body = int(response.json().get("max_body_bytes", 0)) if response.ok else 0
            except (requests.RequestException, ValueError, AttributeError):
                return None  # unreachable now: _post's retries report it; ask again next call
        return self._max_body or None

    def _post(self, body: bytes) -> Scores:
        try:
            response = self.session.post(
                f"{self.url}/score", data=body, headers={"Content-Type": CONTENT_TYPE}, timeout=self.timeout
            )
        except requests.RequestException as error:
            raise RewardUnavailable(
                f"reward server {self._shown_url} failed after {self.retries} retries: {mask_uri(str(error))}"
            ) from error
        if response.status_code == 422:  # a served reward needs a prompt column: a config mistake, not an outage
            raise UserError(f"reward server {self._shown_url}: {_error_text(response)}")
        if response.status_code != 200:
            raise RewardUnavailable(
                f"reward server {self._shown_url} answered {response.status_code}: {response.text[:300]}"
            )
        return decode_response(response.content)


def _error_text(response: requests.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
