"""The gateway's side of admission control: what it admitted that the scheduler's load view does
not show yet, the learned headroom per model, and when refused clients are expected back.

The pure decision is gateway/admission.py; this keeps its state. A request the gateway admitted
counts ahead of later arrivals until a view counts it (the view's seen_us for this gateway
reaches its enqueue, or the view was taken after Redis confirmed it), or it is over: answered or
given up (an idle scheduler publishes no view after its answer, so waiting for one would count it
ahead of every arrival until the view expires).

Under overload most arrivals are refused, and each refusal's CPU comes from the model's on a shared
host: a request like one just refused as overload (the same model, priority and size, no more
time) is refused by that verdict, without playing the queue again, until the view changes, a
request this gateway admitted is over, the headroom moves, or the time comes when it would fit.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from batchline import contract, metrics
from batchline.contract.keys import ModelKey
from batchline.errors import BatchlineError, DeadlineExceeded
from batchline.planning import DEADLINE_AWARE, Pending
from batchline.protocol import internal_pb2 as pb
from gateway.admission import Calibration, Candidate, Overloaded, assess, retry_spacing_s
from gateway.request import Call


@dataclass(slots=True)
class Admitted:
    """A request this gateway admitted, counted ahead of later arrivals until a view counts it."""
    item: Pending          # as admission plays it
    enqueued_us: int = 0   # its QueueEntry's: a view whose seen_us for this gateway reaches it counts it
    confirmed_us: int = 0  # when Redis confirmed the enqueue (0: not yet)
    over: bool = False     # answered or given up: ahead of nobody


class Ticket:
    """An admitted request's part in the ledger, told by the gateway as the request moves: `queued`
    when its entry is stamped, `confirmed` once Redis has it, `over` when it is answered or given up
    (whether in time, when that says something about the predictions, feeds the calibration)."""

    __slots__ = ("_ledger", "record", "calibration")

    def __init__(self, ledger: "AdmissionLedger", record: Admitted, calibration: Calibration | None) -> None:
        self._ledger, self.record, self.calibration = ledger, record, calibration

    def queued(self, enqueued_us: int) -> None:
        self.record.enqueued_us = enqueued_us

    def confirmed(self, at_us: int) -> None:
        self.record.confirmed_us = at_us

    def over(self, in_time: bool | None = None) -> None:
        """Answered or given up; `in_time` (None: it tells nothing) is learned from, once."""
        if self.record.over:
            return
        self._ledger.done(self.record)
        if in_time is not None and self.calibration is not None:
            self.calibration.observe(in_time)


@dataclass(frozen=True, slots=True)
class _Refusal:
    """The last overload refusal at one model and priority level, with what it was judged on."""
    verdict: Overloaded
    view: pb.ModelLoad  # the view it was judged by (the object: two reads of one update may differ in seen_us)
    epoch: int          # the ledger's epoch
    headroom: float
    rows: int
    length: int
    budget_s: float

    def covers(self, call: Call, view: pb.ModelLoad, epoch: int, headroom: float, now_s: float) -> bool:
        """Whether `call` is refused by the same verdict: nothing it was judged on changed, and the
        call is of the same size with no more time (which only moves its deadline earlier), yet
        enough to be refused as overload rather than as hopeless."""
        return (now_s < self.verdict.holds_until_s and view is self.view and epoch == self.epoch
                and headroom == self.headroom and call.rows == self.rows and call.length == self.length
                and self.verdict.shortest_budget_s <= call.run_budget_s <= self.budget_s)


class AdmissionLedger:
    def __init__(self, gateway_id: str, headroom: float, target: float) -> None:
        self.gateway_id = gateway_id
        self.headroom = headroom  # the setting: used as is, or where the learned one starts
        self.target = target      # share of admitted requests to answer in time (0: do not learn)
        self._admitted: dict[ModelKey, deque[Admitted]] = defaultdict(deque)
        self._calibrations: dict[tuple[str, str, bool], Calibration] = {}  # per model, and over-share or not
        # When the requests refused so far are expected back (time.time()), per model and
        # priority level: later refusals are told to come after them (admission.retry_spacing_s).
        self._retries_at: dict[tuple[str, str, int], float] = {}
        # The last overload refusal per model and priority level, which later requests like it are
        # refused by until what it was judged on changes; an answered request changes the epoch.
        self._refusals: dict[tuple[str, str, int], _Refusal] = {}
        self._epoch = 0

    def check(self, load: pb.ModelLoad, call: Call, arrived_us: int, gateways: int) -> Ticket:
        """Admit `call` by the view `load`, or raise the refusal. The ticket counts it ahead of later
        arrivals until a view counts it or it is over."""
        key = call.key
        calibration = self.calibration(key, over_share=call.priority > contract.OVER_SHARE)
        headroom = calibration.headroom if calibration else self.headroom
        candidate = Candidate(call.rows, call.priority, call.run_budget_s, call.length, stated_budget_s=call.budget_s)
        now_s = arrived_us / 1e6
        retry_key = (*key, call.priority)
        last = self._refusals.get(retry_key)
        if last is not None and last.covers(call, load, self._epoch, headroom, now_s):
            metrics.REFUSALS_REUSED.labels(*key).inc()
            self._refused(load, call, retry_key, last.verdict.refusal(call.model, candidate, now_s,
                                                                     self._retries_at.get(retry_key, 0.0)),
                          now_s, gateways)
        admitted = self._admitted[key]
        seen_us = load.seen_us.get(self.gateway_id, 0)
        while admitted and (admitted[0].over or 0 < admitted[0].confirmed_us <= load.updated_us
                            or admitted[0].enqueued_us <= seen_us):
            # The scheduler's view already counts these, or they are over. (A view taken after
            # Redis had a request may still predate its confirmation here: seen_us says which
            # it read. This gateway's requests reach Redis in the order they were stamped.)
            admitted.popleft()
        since = [a.item for a in admitted if a.item.priority <= call.priority and not a.over]
        verdict = assess(load, call.model, candidate, now_s, since, headroom)
        if isinstance(verdict, Overloaded):
            self._refusals[retry_key] = _Refusal(verdict, load, self._epoch, headroom, call.rows,
                                                 call.length, call.run_budget_s)
            verdict = verdict.refusal(call.model, candidate, now_s, self._retries_at.get(retry_key, 0.0))
        if verdict is not None:
            self._refused(load, call, retry_key, verdict, now_s, gateways)
        record = Admitted(Pending("", call.rows, call.priority, now_s + call.run_budget_s, float("-inf"),
                                  length=call.length))
        admitted.append(record)
        return Ticket(self, record, calibration)

    def done(self, record: Admitted) -> None:
        """`record`'s request was answered or given up: it is ahead of nobody, and refusals judged
        while it was queued may no longer hold."""
        record.over = True
        self._epoch += 1

    def _refused(self, load: pb.ModelLoad, call: Call, retry_key: tuple[str, str, int], refusal: BatchlineError,
                 now_s: float, gateways: int) -> None:
        if refusal.retry_after_s is not None:
            spacing = retry_spacing_s(load, call.rows * max(1, call.length), gateways)
            self._retries_at[retry_key] = now_s + refusal.retry_after_s + spacing
        reason = "deadline" if isinstance(refusal, DeadlineExceeded) else "overload"
        metrics.REJECTED.labels(call.model.name, call.model.version, reason).inc()
        raise refusal

    def calibration(self, key: ModelKey, over_share: bool = False) -> Calibration | None:
        """Admission's learned headroom for a model (None: the headroom is the setting). Requests of
        tenants over their share learn one of their own: queued behind everyone's, they miss more
        often, and that must not make admission refuse the requests of the tenants within theirs."""
        if self.target <= 0:
            return None
        calibration = self._calibrations.get((*key, over_share))
        if calibration is None:
            calibration = self._calibrations[(*key, over_share)] = Calibration(self.target, self.headroom)
            if not over_share:
                metrics.ADMISSION_HEADROOM.labels(*key).set_function(lambda: calibration.headroom)
        return calibration


def usable(load: pb.ModelLoad | None, arrived_us: int) -> bool:
    """Whether admission goes by this view: the deadline policy's, and fresh enough."""
    return (load is not None and load.policy == DEADLINE_AWARE
            and arrived_us - load.updated_us < contract.LOAD_TTL_MS * 1000)
