"""Admission: a lease from the rate-limit service before dispatch, real usage committed after.

    reservation = generation_reservation(request)        # or embedding_reservation(request)
    ticket = await admission.admit(tenant, reservation, context.time_remaining(), record)   # may raise
    ... stream, the GenerateStream updating the record with each adapter chunk (Embed: ticket.record(usage)) ...
    ticket.settle()                                                                  # in `finally`

Every call costs one request. Tokens reserved: the estimated input + max_tokens (0 for Embed). The
input is NOT tokenized here (the adapter's CountTokens costs a Triton round trip on every request):
it is estimated as UTF-8 bytes / 3, which over-reserves for English (~4 bytes per token), plus
framing: for a chat, 4 tokens per message (ChatML) and 32 for what a chat template adds
(SmolLM2's inserts a default system prompt of ~20 tokens); for Embed, 2 per input ([CLS] and
[SEP]). Commit sends the real usage (Generate: the final chunk's prompt + completion tokens;
Embed: the reply's usage), so the difference is refunded at once; a call that ends without usage
(cancelled, failed, or an adapter that reports none) commits the input estimate plus the tokens
the chunks carried. The ticket keeps no count of its own: it reads the stream's StreamRecord
(stream_record.py), the one account of the stream that the CompletionEvent and the default
deadline read too.

Failures: Acquire is bounded by SLUICE_GATEWAY_RATELIMIT_TIMEOUT_S and by the request's deadline,
so a call never hangs on an unreachable rate-limit. A call whose own deadline ran out while it
waited answers DEADLINE_EXCEEDED; otherwise, when rate-limit could not decide (UNAVAILABLE,
DEADLINE_EXCEEDED, CANCELLED), the policy applies: "closed" (default) answers UNAVAILABLE; "open"
admits without a lease. Any other error rate-limit answers (INVALID_ARGUMENT, INTERNAL,
UNIMPLEMENTED, ...) is no outage: the call is answered INTERNAL and never admitted, whatever the policy. A grant that reaches a call cancelled while it waited
is given back (Release). A denial answers RESOURCE_EXHAUSTED with
google.rpc.RetryInfo and QuotaFailure; a request larger than a whole limit (it can never be
admitted) answers RESOURCE_EXHAUSTED with QuotaFailure and no RetryInfo; a denial by a fail-closed budget whose Redis is unreachable
(degraded) answers UNAVAILABLE. Commit runs in a background task after the call ended, so it
never delays the client; if it fails, the lease frees its capacity when it expires. A lease lives
at most SLUICE_GATEWAY_RATELIMIT_LEASE_TTL_S at a time: a call that runs longer renews it until
settled (lease_renewal.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf import duration_pb2
from prometheus_client import Counter, Histogram
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_common.errors import DeadlineExceeded, ResourceExhausted, SluiceError, Unavailable
from sluice_common.prompt_tokens import estimate_prompt_tokens, guess_text_tokens
from sluice_common.request_context import current_request_id, outgoing_metadata
from sluice_common.errors import clip
from sluice_gateway.path.lease_renewal import first_ttl, keep_alive, needs_renewal
from sluice_gateway.path.stream_record import StreamRecord

log = structlog.stdlib.get_logger("sluice.gateway.admission")

DECISIONS = Counter(
    "sluice_gateway_ratelimit_decisions_total",
    "Admission outcomes: allowed, shadow, denied, too_large (more than a whole limit), degraded (fail-closed "
    "budget without Redis), deadline (the request's deadline passed while it waited), unreachable_closed, unreachable_open,"
    " error (rate-limit answered another error: INTERNAL, never admitted).",
    ["result"],
)
# The gateway's share of a request's time spent on admission: `sluice diagnose` sets it beside the
# stream's whole time (sluice_rpc_duration_seconds) to say how much of it is rate-limit wait.
WAIT_SECONDS = Histogram(
    "sluice_gateway_ratelimit_wait_seconds",
    "Time a call waited for rate-limit's admission decision (the Acquire round trip), whatever the decision.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
COMMITS = Counter(
    "sluice_gateway_ratelimit_settles_total",
    "Leases settled after a stream, by outcome: ok, released_unheard (granted to a call cancelled while it waited), or the gRPC code.",
    ["result"],
)

# The Acquire failures that mean rate-limit could not decide (down, restarting, overloaded past the
# timeout): the failure policy applies to these only. CANCELLED: a rate-limit shutting down cancels
# the calls in flight (a call of this gateway's own cancelled raises asyncio.CancelledError instead).
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})

# What an embedding tokenizer adds to each input ([CLS] and [SEP] for BERT-style models).
TOKENS_PER_EMBED_INPUT = 2
# Beyond the request's own deadline, how long the lease outlives it (commit travel time).
LEASE_MARGIN_S = 30.0
COMMIT_TIMEOUT_S = 5.0
# How long a stream's last chunk waits for its lease's commit (Ticket.settle_before_end): a commit
# takes a millisecond or two; a slow rate-limit delays the end of a stream by at most this.
END_COMMIT_WAIT_S = 0.25

_B = ratelimit_pb2
_REQUEST_BUDGETS = (_B.BUDGET_REQUESTS_PER_MINUTE, _B.BUDGET_REQUESTS_IN_FLIGHT)
_TOKEN_BUDGETS = (_B.BUDGET_TOKENS_PER_MINUTE, _B.BUDGET_TOKENS_IN_FLIGHT)


def message_pairs(request: gateway_pb2.GenerateRequest) -> list[tuple[str, str]]:
    """The request's chat as sluice_common.prompt_tokens takes it: (role, content) pairs."""
    return [(m.role, m.content) for m in request.messages]


def prompt_estimate(request: gateway_pb2.GenerateRequest) -> int:
    """The prompt's guessed tokens, for a reservation that the commit settles to the real count."""
    return estimate_prompt_tokens(message_pairs(request), request.prompt, request.prompt_token_ids)


def estimate_embedding_tokens(request: gateway_pb2.EmbedRequest) -> int:
    return sum(guess_text_tokens(text) + TOKENS_PER_EMBED_INPUT for text in request.inputs)


@dataclass(frozen=True)
class Reservation:
    """What one call asks of the rate-limit service: one request and `reserved_tokens`."""

    model: str
    priority_class: int
    # Committed when the call ends without real usage.
    estimated_input_tokens: int
    # The estimated input plus the most the call may generate.
    reserved_tokens: int


def _priority(priority_class: int) -> int:
    return priority_class or types_pb2.PRIORITY_CLASS_INTERACTIVE


def generation_reservation(request: gateway_pb2.GenerateRequest, prompt_tokens: int | None = None) -> Reservation:
    """`prompt_tokens`: the prompt's exact count when the gateway had the model count it."""
    prompt = prompt_estimate(request) if prompt_tokens is None else prompt_tokens
    # n sequences share the prompt's prefill and each may generate max_tokens.
    choices = max(1, request.sampling.n)
    return Reservation(request.model, _priority(request.priority_class), prompt, prompt + choices * request.sampling.max_tokens)


def combined(reservations: list[Reservation]) -> Reservation:
    """One lease for several prompts answered as one request: every prompt's tokens and outputs."""
    first = reservations[0]
    return Reservation(
        first.model, first.priority_class,
        sum(r.estimated_input_tokens for r in reservations), sum(r.reserved_tokens for r in reservations),
    )  # fmt: skip


def embedding_reservation(request: gateway_pb2.EmbedRequest) -> Reservation:
    inputs = estimate_embedding_tokens(request)
    return Reservation(request.model, _priority(request.priority_class), inputs, inputs)


def format_reset(seconds: float) -> str:
    """OpenAI's format of x-ratelimit-reset-*: "20ms", "1s", "6m0s"."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def ratelimit_headers(budgets: list[ratelimit_pb2.BudgetStatus]) -> tuple[tuple[str, str], ...]:
    by_budget = {b.budget: b for b in budgets}
    headers: list[tuple[str, str]] = []
    for suffix, candidates in (("requests", _REQUEST_BUDGETS), ("tokens", _TOKEN_BUDGETS)):
        status = next((by_budget[c] for c in candidates if c in by_budget), None)
        if status is None:
            continue
        headers += [
            (f"x-ratelimit-limit-{suffix}", str(status.limit)),
            (f"x-ratelimit-remaining-{suffix}", str(status.remaining)),
            (f"x-ratelimit-reset-{suffix}", format_reset(status.reset_after.ToNanoseconds() / 1e9)),
        ]
    return tuple(headers)


def _too_large(tenant: str, reservation: Reservation, budget: str, budgets: list[ratelimit_pb2.BudgetStatus]) -> ResourceExhausted:
    """A request that costs more than the whole allowance: refused as such, without RetryInfo."""
    limit = next((f" of {b.limit}" for b in budgets if ratelimit_pb2.Budget.Name(b.budget).removeprefix("BUDGET_").lower() == budget), "")
    cost = f"{reservation.reserved_tokens} tokens (the prompt's estimate plus max_tokens)" if "tokens" in budget else "1 request"
    return ResourceExhausted(
        f"request too large: it needs {cost}, more than the whole {budget} allowance{limit} of tenant {tenant} on"
        f" {reservation.model}; no retry can admit it: shorten the prompt or lower max_tokens",
        retry_after_s=None,
        quota_subject=f"tenant:{tenant}/model:{reservation.model}/{budget}",
        metadata=ratelimit_headers(budgets),
    )


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.ToNanoseconds() / 1e9


@dataclass
class Ticket:
    """One admitted call: its lease, the headers to send, and the record of what the call used."""

    admission: Admission | None = None
    lease_id: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    # The estimated input (prompt, or Embed's inputs): committed, plus the chunks' tokens, without usage.
    estimated_input_tokens: int = 0
    # The requests-per-minute budget's limit, when the lease has one (x-ratelimit-limit-requests
    # holds the in-flight limit when the tenant has no per-minute budget): the job worker's rate.
    requests_per_minute: float | None = None
    # What the call used, read when the lease is settled: a Generate's stream record (its
    # GenerateStream updates it), or an Embed's, which holds only the reply's usage (`record`).
    stream: StreamRecord = field(default_factory=StreamRecord)
    # Renews the lease while the call runs past the TTL rate-limit granted (lease_renewal.py).
    renewal: asyncio.Task[None] | None = field(default=None, repr=False)
    _settled: bool = field(default=False, repr=False)

    def record(self, usage: types_pb2.Usage) -> None:
        """An Embed reply's usage, committed by `settle` (an empty one commits the estimate)."""
        self.stream.usage = usage

    def settle(self) -> asyncio.Task[None] | None:
        """Commits the real usage in the background; safe to call more than once and when cancelled.
        Returns the commit's task the first time (None when there is nothing to commit)."""
        if self.renewal is not None:
            self.renewal.cancel()
        if self._settled or not self.lease_id or self.admission is None:
            return None
        self._settled = True
        return self.admission.commit_later(self.lease_id, self.stream.used_tokens(self.estimated_input_tokens))

    async def settle_before_end(self, wait_s: float = END_COMMIT_WAIT_S) -> None:
        """Settles, and waits (at most `wait_s`) for the commit to be answered: a client that sends
        its next request as soon as it hears this one end must find the in-flight slot free, not be
        refused for a second behind a commit still on its way. The commit goes on if the wait ends."""
        task = self.settle()
        if task is not None:
            await asyncio.wait({task}, timeout=wait_s)


class Admission:
    def __init__(
        self, stub: ratelimit_pb2_grpc.RateLimitServiceStub | None, policy: str = "closed", timeout_s: float = 0.5, lease_ttl_s: float = 60.0
    ) -> None:
        self._stub = stub
        self._policy = policy
        self._timeout_s = timeout_s
        # The longest a lease is asked to live before its call renews it (lease_renewal.py).
        self._lease_ttl_s = lease_ttl_s
        self._pending: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: str, reservation: Reservation, time_remaining: float | None, record: StreamRecord | None = None) -> Ticket:
        """A lease for one call (Generate or Embed), or RESOURCE_EXHAUSTED / UNAVAILABLE. `record`:
        the stream's, which the commit reads (None: an Embed's, which `Ticket.record` fills)."""
        record = StreamRecord() if record is None else record
        if self._stub is None:
            return Ticket(stream=record)
        model = reservation.model
        timeout = self._timeout_s if time_remaining is None else max(0.0, min(self._timeout_s, time_remaining))
        acquire = ratelimit_pb2.AcquireRequest(
            tenant=tenant,
            model=model,
            priority_class=reservation.priority_class,
            requests=1,
            reserved_tokens=reservation.reserved_tokens,
            request_id=current_request_id(),
        )
        wanted_s = None if time_remaining is None else time_remaining + LEASE_MARGIN_S
        acquire.lease_ttl.FromNanoseconds(int(first_ttl(wanted_s, self._lease_ttl_s) * 1e9))
        started = time.perf_counter()
        # Shielded: a call cancelled (its client gone) while rate-limit decides must still hear a
        # grant, to give it back; a grant nobody heard would hold its capacity until it expired.
        acquiring = asyncio.ensure_future(self._stub.Acquire(acquire, timeout=timeout, metadata=outgoing_metadata()))
        try:
            reply = await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            acquiring.add_done_callback(self._give_back_unheard)
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time_remaining is not None and time_remaining <= self._timeout_s:
                DECISIONS.labels("deadline").inc()
                raise DeadlineExceeded(f"the request's deadline ({time_remaining:.3f}s left) passed while it waited for admission") from None
            if exc.code() not in _UNREACHABLE:
                # rate-limit answered, and refused the call for a reason of its own (a bug, a version
                # skew): no failure policy admits that without limits, and no retry later mends it.
                DECISIONS.labels("error").inc()
                log.error("ratelimit_failed", code=exc.code().name, details=exc.details(), request_id=current_request_id())
                raise SluiceError(f"the rate-limit service answered {exc.code().name}: {clip(exc.details() or '', 256)}") from None
            return self._unreachable(exc, record)
        finally:
            WAIT_SECONDS.observe(time.perf_counter() - started)
        if not reply.allowed:
            budget = ratelimit_pb2.Budget.Name(reply.denied_by).removeprefix("BUDGET_").lower()
            retry_after = _seconds(reply.retry_after)
            if reply.degraded:
                DECISIONS.labels("degraded").inc()
                raise Unavailable(f"rate limits cannot be checked now ({budget} is fail-closed); retry after {retry_after:.1f}s", retry_after)
            if reply.exceeds_limit:
                DECISIONS.labels("too_large").inc()
                raise _too_large(tenant, reservation, budget, list(reply.budgets))
            DECISIONS.labels("denied").inc()
            raise ResourceExhausted(
                f"rate limit exceeded: {budget} of tenant {tenant} on {model}; retry after {retry_after:.2f}s",
                retry_after_s=retry_after,
                quota_subject=f"tenant:{tenant}/model:{model}/{budget}",
                metadata=ratelimit_headers(list(reply.budgets)),
            )
        DECISIONS.labels("shadow" if reply.shadow else "allowed").inc()
        per_minute = next((b.limit for b in reply.budgets if b.budget == _B.BUDGET_REQUESTS_PER_MINUTE and b.limit > 0), None)
        headers = ratelimit_headers(list(reply.budgets))
        ticket = Ticket(self, reply.lease_id, headers, reservation.estimated_input_tokens, requests_per_minute=per_minute, stream=record)
        granted_s = _seconds(reply.lease_ttl)
        if reply.lease_id and needs_renewal(granted_s, wanted_s):
            wanted_until = None if wanted_s is None else time.monotonic() + wanted_s
            ticket.renewal = asyncio.get_running_loop().create_task(
                keep_alive(self._stub, reply.lease_id, granted_s, wanted_until, self._lease_ttl_s)
            )
        return ticket

    def _unreachable(self, exc: grpc.aio.AioRpcError, record: StreamRecord) -> Ticket:
        log.warning("ratelimit_unreachable", code=exc.code().name, details=exc.details(), policy=self._policy)
        if self._policy == "open":
            DECISIONS.labels("unreachable_open").inc()
            return Ticket(stream=record)
        DECISIONS.labels("unreachable_closed").inc()
        raise Unavailable(f"the rate-limit service is unreachable ({exc.code().name}); retry later")

    def _give_back_unheard(self, acquiring: asyncio.Future[ratelimit_pb2.AcquireResponse]) -> None:
        if acquiring.cancelled() or acquiring.exception() is not None:
            return
        reply = acquiring.result()
        if reply.allowed and reply.lease_id:
            self._track(self._release(reply.lease_id, outgoing_metadata()))

    def _track(self, coro) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _release(self, lease_id: str, metadata: tuple[tuple[str, str], ...]) -> None:
        assert self._stub is not None
        try:
            await self._stub.Release(ratelimit_pb2.ReleaseRequest(lease_id=lease_id), timeout=COMMIT_TIMEOUT_S, metadata=metadata)
            COMMITS.labels("released_unheard").inc()
        except grpc.aio.AioRpcError as exc:
            COMMITS.labels(exc.code().name).inc()
            log.warning("ratelimit_release_failed", lease_id=lease_id, code=exc.code().name, details=exc.details())

    def commit_later(self, lease_id: str, used_tokens: int) -> asyncio.Task[None]:
        return self._track(self._commit(lease_id, used_tokens, outgoing_metadata()))

    async def _commit(self, lease_id: str, used_tokens: int, metadata: tuple[tuple[str, str], ...]) -> None:
        assert self._stub is not None
        try:
            await self._stub.Commit(
                ratelimit_pb2.CommitRequest(lease_id=lease_id, used_tokens=used_tokens), timeout=COMMIT_TIMEOUT_S, metadata=metadata
            )
            COMMITS.labels("ok").inc()
        except grpc.aio.AioRpcError as exc:
            COMMITS.labels(exc.code().name).inc()
            log.warning("ratelimit_commit_failed", lease_id=lease_id, code=exc.code().name, details=exc.details())

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits for the commits still in flight (at shutdown)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
