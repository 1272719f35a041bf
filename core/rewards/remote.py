"""The ``remote`` reward: scores from a reward server (``sagegrpo serve-reward``), so a large reward model can run
on its own GPUs while training runs elsewhere.

Requests go out ``batch_size`` videos at a time. Connection errors, read timeouts and 5xx answers are retried by
urllib3's ``Retry`` with exponential backoff; once retries are spent the reward raises ``RewardUnavailable`` and
the scorer scores those samples None (dropped from their groups) instead of stopping training.
"""

from __future__ import annotations

import requests
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

from .base import RewardUnavailable, Scores, VideoBatch, join_batches
from .wire import CONTENT_TYPE, decode_response, encode_request

RETRIED_STATUSES = (500, 502, 503, 504)


class RemoteReward:
    """Calls ``POST {url}/score``; reports whatever dimensions the server's rewards report."""

    def __init__(self, url: str, timeout: float = 300.0, retries: int = 3, batch_size: int = 8,
                 backoff: float = 0.5):
        if batch_size < 1 or retries < 0 or timeout <= 0:
            raise ValueError("remote reward needs batch_size >= 1, retries >= 0 and timeout > 0")
        self.url, self.timeout, self.retries, self.batch_size = url.rstrip("/"), timeout, retries, batch_size
        # Scoring has no side effects, so retrying a POST is safe: allowed_methods=None retries every method.
        retry = Retry(total=retries, backoff_factor=backoff, status_forcelist=RETRIED_STATUSES,
                      allowed_methods=None, raise_on_status=False)
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        return join_batches([self._post(videos[start:start + self.batch_size], prompts[start:start + self.batch_size])
                             for start in range(0, len(videos), self.batch_size)])

    def _post(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        try:
            response = self.session.post(f"{self.url}/score", data=encode_request(videos, prompts),
                                         headers={"Content-Type": CONTENT_TYPE}, timeout=self.timeout)
        except requests.RequestException as error:
            raise RewardUnavailable(f"reward server {self.url} failed after {self.retries} retries: {error}") from error
        if response.status_code != 200:
            raise RewardUnavailable(f"reward server {self.url} answered {response.status_code}: "
                                    f"{response.text[:300]}")
        return decode_response(response.content)
