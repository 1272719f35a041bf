"""``serve-reward CONFIG --port P``: serve configured rewards over HTTP for the ``remote`` reward.

Endpoints: ``GET /health`` -> ``{"status": "ok", "rewards": [names], "max_body_bytes": N}`` (open, for probes; 503
with ``"status": "unhealthy"`` and the reason while the server cannot score); ``POST /score`` with a safetensors
request (see ``wire``) -> ``{"dimensions": {...}}`` with every reward's raw, unweighted dimensions (the client weighs
them). Each reward gets the request's prompt columns it takes (keyword arguments, as in process); a request lacking a
column a reward requires is answered 422 naming it.

A shared service that treats every request as untrusted data (``ServerSettings`` holds the bounds), served by
uvicorn (HTTP/1.1 parsing by h11, one asyncio loop):
- it binds loopback unless told otherwise, and never unpickles;
- a request must arrive whole (request line, headers and body) within ``read_timeout_s`` of its connection (or of
  its first byte, on a kept-alive connection), else it is answered 408 and closed; an idle connection between
  requests is closed after 5 s. An idle, trickling or unauthenticated client holds a connection and the bytes it
  sent, never a worker or a thread;
- at most ``max_connections_per_client`` connections are open from one address (one more is answered 503 and
  closed at once, so one peer's idle sockets cannot crowd out the others) and ``max_connections`` over all (beyond,
  uvicorn answers requests 503);
- ``Content-Length`` is checked against ``max_body_mb`` before the body is read, and the bodies held (received or
  being scored) stay within ``workers x max_body_mb`` together (503 beyond);
- with a token configured, ``/score`` needs ``Authorization: Bearer <token>`` (compared in constant time) before its
  body is read;
- a whole request to score is decoded on one of ``workers`` threads; with every one busy it is answered 503 at once
  and the client retries; everything else (health, refusals) is answered on the loop;
- every bad request is answered 4xx with one log line, never a traceback; a reward that raises answers 500 (the
  client retries).
uvicorn has the server-wide bounds; the per-client limit and the whole-request deadline are ``_bounded_protocol``, a
subclass of uvicorn's h11 protocol (uvicorn has neither).
Rewards run one call at a time (GPU reward models are not thread-safe); requests that wait for the scorer together
are merged into one batch of up to ``max_batch`` videos (the reward contract scores each video on its own, so merging
changes no score) and each client gets its own slice back. A call that outlives ``request_timeout_s`` is abandoned
(Python cannot stop a thread): its clients get 503, ``/health`` answers 503, and a fresh set of rewards is built for
what follows, since the old set is still inside that call. Abandoned calls still running hold their rewards' memory:
with more than ``max_hung_calls`` of them the server stays unhealthy until one returns (or a supervisor that probes
``/health`` replaces it).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from http import HTTPStatus

import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import config_loading
from ..errors import UserError, first_line
from ..secrets import read_secret
from .base import (
    Columns,
    MetadataParameters,
    Scores,
    VideoBatch,
    check_scores,
    join_batches,
    merge_dimensions,
    slice_columns,
)
from .registry import RewardSpec, build_reward
from .wire import BadRequest, ScoringRequest, decode_request, encode_response

logger = logging.getLogger(__name__)


class ServerSettings(BaseModel):
    """The service's bounds; peak request memory is about ``workers x max_body_mb``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_body_mb: float = Field(1024.0, gt=0)  # one request's body (8 videos of 121 x 480 x 848 fit in 1 GB)
    workers: int = Field(8, ge=1)  # connections handled at once
    read_timeout_s: float = Field(60.0, gt=0)  # to receive one whole request
    request_timeout_s: float = Field(600.0, gt=0)  # to score one request, waiting for the scorer included
    max_batch: int = Field(32, ge=1)  # videos per merged reward call (a bigger single request is scored alone)
    max_connections: int = Field(512, ge=1)  # open at once over all clients; beyond, requests are answered 503
    max_connections_per_client: int = Field(64, ge=1)  # open at once from one address; one more is answered 503
    max_hung_calls: int = Field(2, ge=0)  # abandoned reward calls still running before the server stays unhealthy
    token_env: str | None = None  # environment variable holding the bearer token clients must send
    token_file: str | None = None  # or a file holding it (a mounted secret)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


class RewardService:
    """The configured rewards; their dimensions merged into one dict. Not thread-safe: call from one thread."""

    def __init__(self, specs: list[RewardSpec]):
        self.rewards = [(spec, build_reward(spec)) for spec in specs]
        self._parameters = {spec.name: MetadataParameters.of(reward) for spec, reward in self.rewards}

    def setup(self, device: str) -> None:
        for _, reward in self.rewards:
            if hasattr(reward, "setup"):
                reward.setup(device)

    def names(self) -> list[str]:
        return [spec.name for spec, _ in self.rewards]

    def check_columns(self, columns: Columns) -> None:
        """A UserError (one line) when a reward requires a column ``columns`` lacks."""
        for spec, _ in self.rewards:
            self._parameters[spec.name].select(columns, spec.name)

    def score(self, videos: VideoBatch, prompts: list[str], columns: Columns | None = None) -> Scores:
        dimensions: Scores = {}
        owners: dict[str, str] = {}
        for spec, reward in self.rewards:
            selected = self._parameters[spec.name].select(columns or {}, spec.name)
            size = spec.batch_size or len(videos)
            chunks = [
                check_scores(
                    reward(
                        videos[start : start + size],
                        prompts[start : start + size],
                        **slice_columns(selected, start, start + size),
                    ),
                    len(prompts[start : start + size]),
                    spec.name,
                )
                for start in range(0, len(videos), size)
            ]
            merge_dimensions(dimensions, join_batches(chunks), spec.name, owners)
        return dimensions


class _Job:
    def __init__(self, request: ScoringRequest):
        self.videos, self.prompts, self.columns, self.future = *request, Future()


def _merged_columns(jobs: list[_Job]) -> Columns:
    """The jobs' columns end to end; a job without a column another has gives None there (as a prompt without it)."""
    names = dict.fromkeys(name for job in jobs for name in job.columns)
    return {name: [v for job in jobs for v in job.columns.get(name, [None] * len(job.prompts))] for name in names}


class CannotScore(RuntimeError):
    """The request's reward call was abandoned (it outlived its timeout), or no rewards are ready to score: 503."""


class Batcher:
    """One reward call at a time; requests queued while it runs are merged (same fps, up to ``max_batch`` videos).

    Each call runs in its own thread, waited on for ``call_timeout_s``; one that outlives it is abandoned and the
    rewards are rebuilt with ``build_service`` (see the module docstring). ``problem`` says why nothing can be scored
    now (None when healthy).
    """

    def __init__(
        self,
        build_service: Callable[[], RewardService],
        max_batch: int,
        call_timeout_s: float,
        max_hung_calls: int,
    ):
        self._build_service, self.max_batch = build_service, max_batch
        self.call_timeout_s, self.max_hung_calls = call_timeout_s, max_hung_calls
        self.service = build_service()
        self.problem: str | None = None
        self._hung: list[threading.Thread] = []
        self._queue: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="reward-dispatcher", daemon=True).start()

    def submit(self, request: ScoringRequest) -> Future:
        job = _Job(request)
        with self._ready:
            # Jobs whose clients timed out leave now, not when a slow call returns: the queue (and the videos it
            # holds) stays bounded by the requests actually waiting, at most one per worker.
            for stale in [queued for queued in self._queue if queued.future.cancelled()]:
                self._queue.remove(stale)
            self._queue.append(job)
            self._ready.notify()
        return job.future

    def _run(self) -> None:
        while True:
            # A job whose client gave up (cancelled future) is dropped here, before it costs a reward call.
            jobs = [job for job in self._next_batch() if job.future.set_running_or_notify_cancel()]
            if jobs:
                self._score(jobs)

    def _next_batch(self) -> list[_Job]:
        with self._ready:
            self._ready.wait_for(lambda: self._queue)
            batch = [self._queue.popleft()]
            size = len(batch[0].videos)
            for job in list(self._queue):
                if job.videos.fps == batch[0].videos.fps and size + len(job.videos) <= self.max_batch:
                    self._queue.remove(job)
                    batch.append(job)
                    size += len(job.videos)
            return batch

    def _score(self, jobs: list[_Job]) -> None:
        if self.problem is not None:  # the rewards could not be rebuilt: nothing can score these
            for job in jobs:
                job.future.set_exception(CannotScore(self.problem))
            return
        videos = VideoBatch([video for job in jobs for video in job.videos], jobs[0].videos.fps)
        prompts = [prompt for job in jobs for prompt in job.prompts]
        outcome: dict[str, object] = {}
        call = threading.Thread(
            target=_call, args=(self.service, outcome, videos, prompts, _merged_columns(jobs)), daemon=True
        )
        call.start()
        call.join(self.call_timeout_s)
        if call.is_alive():
            return self._abandon(call, jobs)
        if "error" in outcome:
            if len(jobs) == 1:
                jobs[0].future.set_exception(outcome["error"])
                return
            for job in jobs:  # one client's videos must not fail the others' requests: score each alone
                self._score([job])
            return
        start = 0
        for job in jobs:
            end = start + len(job.videos)
            job.future.set_result({name: values[start:end] for name, values in outcome["dimensions"].items()})
            start = end

    def _abandon(self, call: threading.Thread, jobs: list[_Job]) -> None:
        """Fail the hung call's jobs and score on with fresh rewards (the old ones are still inside that call)."""
        for job in jobs:
            job.future.set_exception(CannotScore(f"scoring did not finish within {self.call_timeout_s:g} s"))
        self._hung = [thread for thread in self._hung if thread.is_alive()] + [call]
        logger.error(
            "a reward call on %d videos did not finish within %g s: abandoned (%d abandoned calls still running), "
            "rebuilding the rewards",
            sum(len(job.videos) for job in jobs),
            self.call_timeout_s,
            len(self._hung),
        )
        while len(self._hung) > self.max_hung_calls:
            self.problem = (
                f"{len(self._hung)} abandoned reward calls still running (max_hung_calls={self.max_hung_calls})"
            )
            self._hung[0].join(1.0)
            self._hung = [thread for thread in self._hung if thread.is_alive()]
        self.problem = "rebuilding the rewards after a reward call hung"
        try:
            self.service = self._build_service()
        except Exception as error:  # noqa: BLE001 (unhealthy for good, said in one line; /health reports it)
            self.problem = f"rebuilding the rewards failed: {first_line(error, with_type=True)}"
            logger.error("%s", self.problem)
            return
        self.problem = None
        logger.info("rewards rebuilt; scoring again")


def _call(service: RewardService, outcome: dict, videos: VideoBatch, prompts: list[str], columns: Columns) -> None:
    """One reward call, its dimensions or error left in ``outcome`` (the thread that made it may be abandoned)."""
    try:
        outcome["dimensions"] = service.score(videos, prompts, columns)
    except Exception as error:  # noqa: BLE001 (a user reward may raise anything; the handler reports it)
        outcome["error"] = error
    except BaseException as error:  # noqa: BLE001 (sys.exit in a reward fails its request, not the scorer)
        outcome["error"] = RuntimeError(f"the reward raised {type(error).__name__}: {error}")


class _Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


_MAX_HEADERS = 100  # header fields in one request (http.client's bound)
_MAX_HEAD = 65536  # the request line and headers together (h11 answers 400 beyond)
_KEEP_ALIVE_S = 5  # an idle connection between two requests is closed after this (uvicorn's default)
_SHUTDOWN_S = 5  # on SIGTERM, requests in flight get this long before they are cancelled


def _check_token(headers, token: str | None) -> None:
    if token is None:
        return
    sent = headers.get("Authorization", "")
    # compare_digest: the time taken does not reveal how much of a guessed token was right.
    if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        raise _Refused(401, "missing or wrong bearer token")


def _declared_length(headers, limit: int) -> int:
    raw = headers.get("Content-Length")
    if raw is None:
        raise _Refused(411, "Content-Length is required")
    try:
        length = int(raw)
    except ValueError:
        raise _Refused(400, f"Content-Length {raw[:40]!r} is not a number") from None
    if not 0 <= length <= limit:
        raise _Refused(413 if length > limit else 400, f"body of {length} bytes (the limit is {limit})")
    return length


def _json_response(status: int, payload: dict) -> Response:
    # Every refusal closes the connection: the body of a refused request is never read, so it cannot carry another.
    headers = {} if status < 400 else {"Connection": "close"} | ({"Retry-After": "1"} if status == 503 else {})
    return JSONResponse(payload, status_code=status, headers=headers)


def _raw_refusal(status: int, reason: str) -> bytes:
    """A whole HTTP answer for the connection layer, which answers before (or instead of) any request."""
    body = json.dumps({"error": reason}).encode()
    retry = "Retry-After: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _log_refusal(client: str, status: int, reason: str, method: str = "", path: str = "") -> None:
    shown = f"{method} {ascii(path[:100])[1:-1]}" if method else "request"  # escaped: no control characters in logs
    logger.warning("refused %s from %s: %d %s", shown, client, status, reason)


class RewardApp:
    """The ASGI application: ``GET /health`` and ``POST /score``, on the server's one event loop.

    A request's head is checked (path, header count, token, ``Content-Length``) before its body is read; the body is
    counted against ``workers x max_body_mb`` while it is held; decoding runs on one of ``workers`` threads and
    scoring in the batcher's, so the loop only moves bytes.
    """

    def __init__(self, batcher: Batcher, settings: ServerSettings, token: str | None):
        self.batcher, self.settings, self.token = batcher, settings, token
        self._decoders = ThreadPoolExecutor(settings.workers, thread_name_prefix="reward-decode")
        # Touched by the loop's thread only.
        self._scoring = self._held_bytes = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off and there is no websocket route
            return
        request = Request(scope, receive)
        client = (scope.get("client") or ("-",))[0]
        try:
            response = await self._answer(request)
        except _Refused as refusal:
            _log_refusal(client, refusal.status, str(refusal), request.method, scope["path"])
            response = _json_response(refusal.status, {"error": str(refusal)})
        except ClientDisconnect:  # it stopped sending (the connection layer answered 408 if its deadline passed)
            return
        except Exception as error:  # noqa: BLE001 (a bug of ours costs one line and a 500, not the server)
            logger.error("answering a request from %s failed: %s", client, first_line(error, with_type=True))
            response = _json_response(500, {"error": "internal error"})
        await response(scope, receive, send)

    async def _answer(self, request: Request) -> Response:
        if len(request.scope["headers"]) > _MAX_HEADERS:
            raise _Refused(431, f"more than {_MAX_HEADERS} header fields")
        route = (request.method, request.scope["path"])
        if route == ("GET", "/health"):
            return self._health()
        if route != ("POST", "/score"):
            raise _Refused(404, f"no such path {request.scope['path']}")
        _check_token(request.headers, self.token)
        length = _declared_length(request.headers, self.settings.max_body_bytes)
        held = 0
        try:
            chunks = []
            async for chunk in request.stream():
                held += len(chunk)
                self._held_bytes += len(chunk)
                chunks.append(chunk)
                if self._held_bytes > self.settings.workers * self.settings.max_body_bytes:
                    raise _Refused(503, "the request bodies held reach workers x max_body_mb")
            if held < length:  # h11 ends a body only at its declared length; shorter is a client that left
                raise ClientDisconnect()
            return await self._score(b"".join(chunks))
        finally:
            self._held_bytes -= held

    def _health(self) -> Response:
        problem = self.batcher.problem
        payload = {
            "status": "ok" if problem is None else "unhealthy",
            "rewards": self.batcher.service.names(),
            "max_body_bytes": self.settings.max_body_bytes,
        }
        return _json_response(200, payload) if problem is None else _json_response(503, payload | {"reason": problem})

    async def _score(self, body: bytes) -> Response:
        if self.batcher.problem is not None:
            raise _Refused(503, f"cannot score now: {self.batcher.problem}")
        if self._scoring >= self.settings.workers:
            raise _Refused(503, f"all {self.settings.workers} workers are busy")
        self._scoring += 1
        try:
            request = await asyncio.get_running_loop().run_in_executor(self._decoders, self._decode, body)
            return await self._scored(request)
        finally:
            self._scoring -= 1

    def _decode(self, body: bytes) -> ScoringRequest:
        try:
            request = decode_request(body)
        except BadRequest as error:
            raise _Refused(400, f"bad request: {error}") from None
        try:
            self.batcher.service.check_columns(request.columns)
        except UserError as error:  # well-formed, but a reward needs a prompt column the request does not carry
            raise _Refused(422, str(error)) from None
        return request

    async def _scored(self, request: ScoringRequest) -> Response:
        future = self.batcher.submit(request)
        timeout = self.settings.request_timeout_s
        try:
            async with asyncio.timeout(timeout):
                # Cancelling the wrapper (the timeout) cancels the job: still queued, it is never scored.
                dimensions = await asyncio.wrap_future(future)
        except (TimeoutError, CannotScore) as error:
            reason = str(error) or f"scoring did not finish within {timeout:g} s"
            logger.error("scoring %d videos: %s", len(request.videos), reason)
            return _json_response(503, {"error": reason})
        except Exception as error:  # noqa: BLE001 (a failing reward: the server's problem, one line, retried)
            message = first_line(error, with_type=True)
            logger.error("scoring %d videos failed: %s", len(request.videos), message)
            logger.debug("scoring failure", exc_info=error)
            return _json_response(500, {"error": message})
        return Response(encode_response(dimensions), media_type="application/json")


def _bounded_protocol(settings: ServerSettings) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with the two bounds uvicorn does not have (it bounds connections over all clients,
    ``limit_concurrency``, and idle time between requests, ``timeout_keep_alive``):

    - connections per client address: one more than ``max_connections_per_client`` is answered 503 and closed at
      once, so one peer's idle sockets cannot use up ``max_connections`` for everyone;
    - a deadline for a whole request: from the connection (or the first byte of a kept-alive connection's next request)
      until the body has arrived, ``read_timeout_s``; then 408 and the connection is closed. uvicorn restarts its only
      timer on every byte, so a client sending half a head, or one byte a second, would be held forever.
    """
    open_from: collections.Counter[str] = collections.Counter()
    warned: set[str] = set()  # clients at their limit, told once in the log until they are under it again

    class BoundedH11Protocol(H11Protocol):
        _counted = False
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            host = (transport.get_extra_info("peername") or ("-",))[0]
            if open_from[host] >= settings.max_connections_per_client:
                # Before uvicorn counts it: a refused connection must not count against max_connections either.
                if host not in warned:
                    warned.add(host)
                    _log_refusal(
                        host, 503, f"{open_from[host]} connections open (max_connections_per_client), closing more"
                    )
                transport.write(_raw_refusal(503, "too many connections from this address"))
                transport.close()
                return
            super().connection_made(transport)
            open_from[host] += 1
            self._counted = True
            self._arm_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._counted:  # refused in connection_made: uvicorn never saw it
                return
            self._disarm_deadline()
            host = self._host()
            open_from[host] -= 1
            if open_from[host] < settings.max_connections_per_client:
                warned.discard(host)
            if not open_from[host]:
                del open_from[host]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_deadline()  # the first bytes of a kept-alive connection's next request
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.more_body:
                self._disarm_deadline()  # the request is whole: request_timeout_s bounds its scoring

        def on_response_complete(self) -> None:
            super().on_response_complete()  # starts on a pipelined request already buffered, if there is one
            cycle, buffered = self.cycle, bool(self.conn.trailing_data[0])
            begun = buffered or (cycle is not None and not cycle.response_complete and cycle.more_body)
            if begun and self._deadline is None and not self.transport.is_closing():
                self._arm_deadline()  # its bytes came before this response: no data_received will arm it

        def send_400_response(self, msg: str) -> None:  # h11 could not parse the request
            _log_refusal(self._host(), 400, "not a well-formed HTTP/1.1 request")
            super().send_400_response(msg)

        def _host(self) -> str:
            return self.client[0] if self.client else "-"

        def _arm_deadline(self) -> None:
            self._deadline = self.loop.call_later(settings.read_timeout_s, self._request_too_slow)

        def _disarm_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _request_too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                reason = f"request not received within {settings.read_timeout_s:g} s"
                _log_refusal(self._host(), 408, reason)
                self.transport.write(_raw_refusal(408, reason))
            self.transport.close()  # a handler still reading the body gets http.disconnect and returns

    return BoundedH11Protocol


class _UvicornsInvalidRequestLine(logging.Filter):
    """Drops uvicorn's own line for a request h11 cannot parse: ``send_400_response`` above logs it with the client."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Invalid HTTP request received."


def serve(specs: list[RewardSpec], host: str, port: int, device: str, settings: ServerSettings | None = None) -> None:
    """Build and set up the rewards, then serve on uvicorn until interrupted. Port 0 picks a free port; the chosen
    address is printed as ``serving rewards on http://HOST:PORT`` once the server accepts connections."""
    settings = settings or ServerSettings()
    token = read_secret(settings.token_env, settings.token_file, what="reward server token")

    def build_service() -> RewardService:
        service = RewardService(specs)
        service.setup(device)
        return service

    batcher = Batcher(build_service, settings.max_batch, settings.request_timeout_s, settings.max_hung_calls)
    try:
        listener = socket.create_server((host, port), backlog=2048)
    except OSError as error:  # port taken, or an address this machine does not have
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    config = uvicorn.Config(
        RewardApp(batcher, settings, token),
        http=_bounded_protocol(settings),
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,  # the process's own logging (the CLI's format) shows uvicorn's warnings
        log_level="warning",
        access_log=False,  # every refusal is logged once, by the app or the protocol above
        proxy_headers=False,  # the client address is the peer's: a header must not choose whose limit applies
        server_header=False,
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=_KEEP_ALIVE_S,
        timeout_graceful_shutdown=_SHUTDOWN_S,
        h11_max_incomplete_event_size=_MAX_HEAD,
    )
    logging.getLogger("uvicorn.error").addFilter(_UvicornsInvalidRequestLine())
    auth = "token required" if token else "no token"
    print(f"serving rewards on http://{host}:{listener.getsockname()[1]}", flush=True)
    logger.info(
        "reward server on uvicorn: %d workers, bodies up to %g MB, %d connections per client, %s",
        settings.workers,
        settings.max_body_mb,
        settings.max_connections_per_client,
        auth,
    )
    try:
        uvicorn.Server(config).run(sockets=[listener])
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()


class _ServedRewards(BaseModel):
    # extra="ignore": a full training config can be served as is; only its rewards are read.
    model_config = ConfigDict(extra="ignore")

    rewards: list[RewardSpec] = Field(min_length=1)


def load_reward_specs(path: str) -> list[RewardSpec]:
    """The ``rewards:`` list of a YAML config; problems are one-line UserErrors naming the key."""
    return config_loading.validate(_ServedRewards, config_loading.read_yaml(path), source=path).rewards
