"""The `slo` policy's step planner: protected chat decodes under a TBT-derived time budget,
least-slack-first chat prefills, batch work in what is left, class-aware preemption, admission
control. Torch-free: it plans through the Scheduler's primitives and never sees the device."""

from __future__ import annotations

import enum
import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmserve.errors import MMServeError
from mmserve.request import SLO, Request, RequestStatus, ServiceClass
from mmserve.scheduler.encoder_cache import EncoderGrant, new_encoder_tokens

if TYPE_CHECKING:
    from mmserve.scheduler.scheduler import Scheduler, _Step

INTERACTIVE, BATCH = ServiceClass.INTERACTIVE, ServiceClass.BATCH
EncoderPlan = list[EncoderGrant]
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class SloInfeasibleError(MMServeError):
    """Admission control in "reject" mode: the request's TTFT target cannot be met at the current
    load. `Scheduler.add_request` raises it before the request is queued; the API answers 429 with
    Retry-After: `retry_after_s`, the predicted time until the interactive work queued ahead drains — or
    without one (`retry_after_s` None) when its own prefill alone cannot meet the target, so a retry never
    would."""

    def __init__(self, message: str, retry_after_s: float | None = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Tier(enum.IntEnum):
    """Service order of prefill work (running chunks and waiting requests alike)."""

    FEASIBLE = 0  # interactive whose target can still be met (or has none): least slack first
    LATE = 1  # interactive past hope (alone, or behind the feasible ones), and aged batch: earliest deadline first
    BATCH = 2  # batch: earliest virtual deadline first, then arrival


class Progress(enum.IntEnum):
    """What a prefill may still get when nothing fits the time left (see _serve_prefill)."""

    NONE = 0
    TOKEN = 1  # one text token (the head of the batch work: a tiny overshoot, so batch never starves)
    GROUP = 2  # or one encoder group, however costly (the head of the LATE tier)


@dataclass
class SloCounters:
    """Cumulative; the engine exports them (see SchedulerStats)."""

    throttled_batch_decodes: int = 0  # (request, step) pairs where a running batch decode was skipped
    forced_batch_decodes: int = 0  # batch decodes granted because they reached the skip bound
    downgraded: int = 0  # interactive requests admission control turned into batch
    rejected: int = 0  # interactive requests admission control refused


class SloPlanner:
    """Plans each step of a Scheduler whose policy is `slo` (Scheduler.schedule calls fill()).

    A step is planned in this order:
      1. mandatory: every running interactive decode, then every batch decode that has already been
         skipped `max_batch_decode_skips` steps in a row (one token each; only the hard token budget
         and memory can refuse them);
      2. prefill work of tier FEASIBLE (interactive, least slack first) then LATE (interactive that can
         no longer meet its target, and aged batch; earliest deadline first), leaving
         `batch_min_share` of the tokens and of the predicted time to batch work when there is some;
      3. batch decodes that may skip, then batch prefills (earliest virtual deadline, then arrival).
    Optional grants are cut so the step's predicted time stays within the tightest TBT target among
    the running interactive decodes and max_step_ms (`Scheduler.step_time_limit`: less the headroom,
    over the error factor); with only batch decodes, within max_step_ms; with no decode, only the token
    budget limits the step.

    Memory: victims are ranked batch prefill > batch decode > late chat prefill > chat prefill with
    the most slack > chat decode; a request may evict only its own class or lower, and a waiting one
    only a lower class. A request preempted `pin_after_preemptions` times is shielded from its own
    class for `pin_ms`. Batch work is admitted only when its whole remaining prompt fits with a block
    to spare for each running chat, so that it is not admitted just to be evicted again.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self.config = scheduler.config
        self.counters = SloCounters()
        self._skips: dict[str, int] = {}  # running batch decode -> steps skipped in a row
        self._pinned_until: dict[str, float] = {}  # not evicted before this clock time
        self._last_served: dict[str, float] = {}  # clock time of the request's latest grant
        # Per step: whether a running request had to evict to grow (then no batch request is admitted this
        # step), and the interactive prefills that cannot all make their targets (see _late_prefills).
        self._now = 0.0
        self._evicted_for_growth = False
        self._late: set[str] = set()
        self._pace_s = math.inf  # the longest step that keeps every interactive stream on its TBT pace
        self.last_time_limit: float = math.inf  # the latest step's planned seconds (see step_time_limit)

    # -- targets -----------------------------------------------------------------------------------
    def effective_slo(self, request: Request) -> SLO:
        """The request's own targets over its class's defaults."""
        own = request.sampling_params.slo or SLO()
        return own.over(self.config.class_slo(request.service_class))

    def deadline(self, request: Request) -> float:
        """Clock time by which the request's next token is due (math.inf: no target).

        Before the first token: arrival + TTFT. After it (a preempted stream being recomputed): its
        last token + TBT. Never later than arrival + deadline_ms.
        """
        slo = self.effective_slo(request)
        due = math.inf
        if request.num_output_tokens == 0:
            if slo.ttft_ms is not None:
                due = request.arrival_time + slo.ttft_ms / 1e3
        elif slo.tbt_ms is not None and request.last_token_time is not None:
            due = request.last_token_time + slo.tbt_ms / 1e3
        if slo.deadline_ms is not None:
            due = min(due, request.arrival_time + slo.deadline_ms / 1e3)
        return due

    def tbt_allowance(self, request: Request, now: float) -> float | None:
        """Seconds the next step may take for a decoding stream (None: no TBT target): its TBT, plus
        its lead on the TBT pace (its tokens so far at TBT each, against the time since its first
        token and this step's wait) up to `tbt_slack_ms`."""
        tbt_ms = self.effective_slo(request).tbt_ms
        if tbt_ms is None:
            return None
        tbt = tbt_ms / 1e3
        if request.first_token_time is None:
            return tbt
        # After n tokens the stream may reach token n + 1 by first + n x TBT with a mean gap <= TBT.
        due = request.first_token_time + request.num_output_tokens * tbt
        return min(max(due - now, tbt), tbt + self.config.tbt_slack_ms / 1e3)

    def _pace_left(self, request: Request, now: float) -> float:
        """Seconds from `now` until a decoding stream's next token is due on its mean TBT pace (after n
        tokens, token n + 1 by first + n x TBT; math.inf: no TBT target)."""
        tbt_ms = self.effective_slo(request).tbt_ms
        if tbt_ms is None or request.first_token_time is None:
            return math.inf
        return request.first_token_time + request.num_output_tokens * tbt_ms / 1e3 - now

    def remaining_prefill_s(self, request: Request) -> float:
        """Predicted seconds to compute the request's uncomputed tokens in one step of its own,
        its not yet encoded media groups included. A lower bound: chunking only adds to it."""
        start = request.num_computed_tokens
        cache, depth = self.sched.encoder_cache, self.sched.encoder_depth
        encoder_tokens = sum(
            mm.tokens_per_group * (1 - cache.blocks_done((mm.mm_hash, g)) / depth if depth else 1)
            for mm in request.mm_inputs
            for g in range(mm.num_groups)
            if mm.group_range(g)[1] > start and not cache.is_cached((mm.mm_hash, g))
        )  # a group part-way through the tower (encoded in slices) by what is left of it
        model = self.sched.step_time
        return model.intercept() + model.grant_cost(start, request.num_tokens - start, encoder_tokens)

    def prefill_rate(self) -> float:
        """The share of wall time that prefill work gets: what the step's time limit leaves after the
        running interactive decodes (1 without a limit), within [0.1, 1]."""
        limit = self.last_time_limit
        if limit == math.inf or limit <= 0.0:
            return 1.0
        model = self.sched.step_time
        decodes = model.intercept() + sum(
            model.grant_cost(r.num_computed_tokens, 1)
            for r in self.sched.running
            if r.is_decoding and r.service_class == INTERACTIVE
        )
        return min(max((limit - decodes) / limit, 0.1), 1.0)

    def _late_prefills(self) -> set[str]:
        """The interactive prefills (running chunks and waiting requests) left out so that as many others
        as possible make their TTFT: Moore-Hodgson over their predicted prefill times, served earliest
        deadline first at `prefill_rate` (when one would finish late, the longest so far is dropped). Least
        slack first alone collapses under overload: it serves the most urgent, who then miss anyway, while
        the ones behind them become urgent in turn."""
        factor = self.sched.step_time.error_factor() / self.prefill_rate()
        jobs = []
        for r in self.sched.requests.values():
            if r.service_class == INTERACTIVE and r.num_output_tokens == 0:
                due = self.deadline(r)
                if due != math.inf:
                    jobs.append((due, r.arrival_seq, factor * self.remaining_prefill_s(r), r.request_id))
        kept: list[tuple[float, int, str]] = []  # max-heap of (-seconds, -seq, id): the longest, latest on top
        total, late = 0.0, set()
        for due, seq, seconds, request_id in sorted(jobs):
            heapq.heappush(kept, (-seconds, -seq, request_id))
            total += seconds
            if self._now + total > due:
                longest, _, dropped = heapq.heappop(kept)
                total += longest
                late.add(dropped)
        return late

    def prefill_key(self, request: Request) -> tuple[Tier, float, int]:
        """Sort key of prefill work: (tier, slack or deadline, arrival order)."""
        if request.service_class == INTERACTIVE:
            due = self.deadline(request)
            slack = due - self._now - self.remaining_prefill_s(request)
            if request.request_id in self._late and due != math.inf:
                return Tier.LATE, due, request.arrival_seq
            if slack >= 0.0 or due == math.inf:
                return Tier.FEASIBLE, slack, request.arrival_seq
            return Tier.LATE, due, request.arrival_seq
        # Batch ages from its latest grant: work that keeps being served never ages.
        aged_at = (
            self._last_served.get(request.request_id, request.arrival_time) + self.config.batch_aging_ms / 1e3
        )
        if self._now >= aged_at:
            return Tier.LATE, aged_at, request.arrival_seq
        return Tier.BATCH, min(self.deadline(request), aged_at), request.arrival_seq

    # -- admission control ----------------------------------------------------------------------
    def admit(self, request: Request, now: float) -> None:
        """Called by add_request before queueing. With admission control on, an interactive request
        whose TTFT cannot be met behind the interactive prefills due before it is downgraded to
        batch ("downgrade") or refused with SloInfeasibleError ("reject")."""
        mode = self.config.admission_control
        if mode == "off" or request.service_class != INTERACTIVE:
            return
        due = self.deadline(request)
        if due == math.inf:
            return
        # The work due before it, at the share of each step that prefills get and the model's error margin.
        factor = self.sched.step_time.error_factor() / self.prefill_rate()
        ahead = factor * sum(
            self.remaining_prefill_s(r)
            for r in self.sched.requests.values()
            if r.service_class == INTERACTIVE and r.num_output_tokens == 0 and self.deadline(r) <= due
        )
        own = factor * self.remaining_prefill_s(request)
        if now + ahead + own <= due:
            return
        if mode == "reject":
            self.counters.rejected += 1
            if now + own > due:  # alone on an idle engine it would still be late: no retry can succeed
                raise SloInfeasibleError(
                    f"the request's time-to-first-token target cannot be met even on an idle engine "
                    f"(predicted {1e3 * (now + own - request.arrival_time):.0f} ms to its first token)",
                    retry_after_s=None,
                )
            raise SloInfeasibleError(
                f"the request's time-to-first-token target cannot be met at the current load "
                f"(predicted {1e3 * (now + ahead - request.arrival_time):.0f} ms of queued work ahead of it)",
                retry_after_s=max(1.0, math.ceil(ahead)),
            )
        request.class_override = BATCH
        self.counters.downgraded += 1

    # -- one step ----------------------------------------------------------------------------------
    def fill(self, step: _Step, now: float) -> None:
        sched = self.sched
        self._now = now
        self._evicted_for_growth = False
        self._forget_finished()
        running = list(sched.running)
        decodes = [r for r in running if r.is_decoding]
        interactive_decodes = [r for r in decodes if r.service_class == INTERACTIVE]
        batch_decodes = [r for r in decodes if r.service_class == BATCH]
        max_skips = self.config.max_batch_decode_skips
        forced = [r for r in batch_decodes if self._skips.get(r.request_id, 0) >= max_skips]

        # The time budget, when interactive streams decode: the tightest TBT target among them (plus what
        # each may lend of its lead, see tbt_allowance) and max_step_ms, less the headroom kept for
        # prediction error (a step planned to exactly the target misses it half the time; see
        # step_time_limit). Batch streams have no TBT target: alone, they limit the step to max_step_ms only,
        # as under every policy (an unbounded batch step would also hold back the chats arriving meanwhile).
        allowances = [a for r in interactive_decodes if (a := self.tbt_allowance(r, now)) is not None]
        tbt = min(allowances, default=math.inf)
        self.last_time_limit = sched.step_time_limit(tbt) if decodes else math.inf
        step.limit_time(self.last_time_limit, sched.step_time.intercept())
        self._late = self._late_prefills()
        self._pace_s = min((self._pace_left(r, now) for r in interactive_decodes), default=math.inf)

        # 1. Mandatory decodes: never skipped for time, only for the hard budget or memory.
        for request in interactive_decodes + forced:
            served = request.status == RequestStatus.RUNNING and self._serve_running(step, request, 1)
            if served and request.service_class == BATCH:
                self.counters.forced_batch_decodes += 1

        # 2.-3. Everything else, in tiers.
        prefills = [
            r
            for r in sched.running
            if not r.is_decoding and r.request_id not in step.grants
        ]
        work = sorted(((self.prefill_key(r), r) for r in [*prefills, *sched.admissible_waiting()]), key=lambda e: e[0])
        urgent = [r for key, r in work if key[0] != Tier.BATCH]
        batch = [r for key, r in work if key[0] == Tier.BATCH]
        optional_decodes = [r for r in batch_decodes if self._skips.get(r.request_id, 0) < max_skips]
        optional_decodes.sort(key=lambda r: -self._skips.get(r.request_id, 0))  # longest-waiting first
        # Minimum progress, in tokens and in predicted seconds: batch work gets it when it has any,
        # and so does the first LATE request, even when the mandatory decodes alone fill the target.
        share = self.config.batch_min_share
        has_batch = bool(batch or optional_decodes)
        reserve_tokens = math.ceil(share * step.budget) if has_batch else 0
        # Of the step as it will run: when the mandatory decodes alone outgrow the limit (the streams miss
        # their TBT this step whatever else runs), the floor grows with them, so prefills are not starved
        # for a target that is lost anyway.
        limit = self.last_time_limit
        floor_seconds = share * max(limit, limit - step.seconds_left) if limit != math.inf else 0.0
        reserve_seconds = floor_seconds if has_batch else 0.0
        first_late = next((r for key, r in work if key[0] == Tier.LATE), None)
        # When the mandatory decodes alone use up the limit, the feasible head moves too (at the floor), as
        # prefill_rate assumes: else a chat judged able to make its TTFT would wait until it is late.
        first_feasible = next((r for key, r in work if key[0] == Tier.FEASIBLE), None) if step.seconds_left <= 0 else None
        for request in urgent:
            progress = (
                Progress.GROUP if request is first_late else Progress.TOKEN if request is first_feasible else Progress.NONE
            )
            self._serve_prefill(step, request, reserve_tokens, reserve_seconds, progress, floor_seconds)
        step.seconds_left = max(step.seconds_left, reserve_seconds)
        for request in optional_decodes:
            if request.status == RequestStatus.RUNNING:
                self._serve_running(step, request, 1, max_seconds=step.seconds_left)
        batch_moved = any(r.request_id in step.grants for r in batch_decodes)
        for request in batch:
            progress = Progress.NONE if batch_moved else Progress.TOKEN
            batch_moved |= self._serve_prefill(step, request, 0, 0.0, progress, floor_seconds)

        for request in batch_decodes:
            if request.status != RequestStatus.RUNNING:
                self._skips.pop(request.request_id, None)  # preempted: no longer a decode
            elif request.request_id in step.grants:
                self._skips.pop(request.request_id, None)
            else:
                self._skips[request.request_id] = self._skips.get(request.request_id, 0) + 1
                self.counters.throttled_batch_decodes += 1

    # -- serving one request ------------------------------------------------------------------------
    def _serve_prefill(
        self,
        step: _Step,
        request: Request,
        reserve_tokens: int,
        reserve_seconds: float,
        progress: Progress,
        floor: float,
    ) -> bool:
        """Grant a running partial prefill its next chunk, or admit a waiting request, within what is
        left of the step after the reserve. With `progress`, the request gets at least `floor`
        seconds, and if even that is too little, its smallest next piece (one text token, or with
        GROUP up to the end of the encoder group it stands in): so a request behind decodes that
        fill the target, or whose groups cost more than the target, still moves. True if granted."""
        sched = self.sched
        max_tokens = step.budget - reserve_tokens
        seconds = step.seconds_left - reserve_seconds
        if progress:
            seconds = max(seconds, floor)
        if max_tokens <= 0 or sched.preempted_since_last_plan(request.request_id):
            return False  # no budget, or evicted earlier in this step: not readmitted in the same step
        if request.status == RequestStatus.RUNNING:
            if request.request_id in step.grants:
                return False
            start = request.num_computed_tokens
            n, plan = sched.fit_to_time(step, request, start, min(request.num_tokens - start, max_tokens), seconds)
            if n <= 0 and not plan and progress:
                n, plan = self._forced_piece(step, request, start, max_tokens, progress)
            if n <= 0:
                return self._serve_encoder_slice(step, request, plan)
            return self._serve_running(step, request, n, plan)
        # Waiting since the step began (victims of this step were turned away above).
        if request.status not in _WAITING or len(sched.running) >= self.config.max_num_seqs:
            return False
        if request.service_class == BATCH and (self._evicted_for_growth or not self._room_for_batch(request)):
            return False  # memory is short: running work first
        while True:
            # Looked up again after each eviction: the victim's freed tail may have held a hit.
            computed_blocks, num_cached = sched.kv.get_computed_blocks(request)
            n, plan = sched.fit_to_time(
                step, request, num_cached, min(request.num_tokens - num_cached, max_tokens), seconds
            )
            if n <= 0 and not plan and progress:
                n, plan = self._forced_piece(step, request, num_cached, max_tokens, progress)
            if n <= 0:
                return self._serve_encoder_slice(step, request, plan)
            if sched.kv.allocate_slots(request, n, computed_blocks) is not None:
                break
            victim = self._victim(request, admitting=True)
            if victim is None:
                return False
            self._preempt(step, victim)
        sched.start_running(request, num_cached)
        self._record_grant(step, request, n, plan)
        return True

    def _forced_piece(
        self, step: _Step, request: Request, start: int, max_tokens: int, progress: Progress
    ) -> tuple[int, EncoderPlan]:
        """The request's smallest next piece from `start` (one token, or with GROUP the rest of the encoder
        group `start` stands in); a piece of more than one token only if the step with it keeps every
        interactive stream on its TBT pace: a
        step may outgrow its planned time only by the lead the streams have built up (steps are planned
        short of TBT, so they build it). Under overload this paces the late requests' forced progress
        instead of stretching every step past the target, which would fail every stream's TPOT at once."""
        sched = self.sched
        used = self.last_time_limit - step.seconds_left  # predicted seconds of the step so far
        # At a group not encoded yet, where the runner encodes in slices: what of the tower the pace allows
        # (with GROUP, at least one block), rather than the whole group at once.
        allowed = math.inf if self.last_time_limit == math.inf else max(self._pace_s, self.last_time_limit) - used
        piece = None
        if sched.is_admitted(request):
            piece = sched.encoder_slice(step, request, start, allowed, at_least_one=progress == Progress.GROUP)
        if piece is not None:
            return 0, [piece]
        unit = min(sched.next_unit(request, start, progress == Progress.GROUP), max_tokens)
        n, plan = sched.plan_encoder(request, start, unit, step) if unit > 0 else (0, [])
        if n <= 0:
            return 0, []
        if n > 1 and self.last_time_limit != math.inf:  # one token is never refused: nobody starves
            cost = sched.step_time.grant_cost(start, n, new_encoder_tokens(plan))
            if used + cost > max(self._pace_s, self.last_time_limit):
                return 0, []
        return n, plan

    def _serve_running(
        self,
        step: _Step,
        request: Request,
        num_tokens: int,
        plan: EncoderPlan | None = None,
        max_seconds: float = math.inf,
    ) -> bool:
        """Allocate blocks for a running request's grant, evicting by the SLO order when memory runs
        out. False if it got nothing (no budget, no time, or nobody it may evict)."""
        sched = self.sched
        start = request.num_computed_tokens
        if plan is None:
            num_tokens, plan = sched.plan_encoder(request, start, min(num_tokens, step.budget), step)
            if num_tokens <= 0:
                return False
            if sched.step_time.grant_cost(start, num_tokens, new_encoder_tokens(plan)) > max_seconds:
                return False
        while sched.kv.allocate_slots(request, num_tokens) is None:
            victim = self._victim(request, admitting=False)
            if victim is None:
                return False  # keeps its blocks and waits for memory
            self._evicted_for_growth = True
            self._preempt(step, victim)
            if victim is request:
                return False
        self._record_grant(step, request, num_tokens, plan)
        return True

    def _serve_encoder_slice(self, step: _Step, request: Request, plan: EncoderPlan) -> bool:
        """A grant of no tokens: a slice of the request's next group's encode, if `plan` holds one."""
        if not plan:
            return False
        self._record_grant(step, request, 0, plan)
        return True

    def _record_grant(self, step: _Step, request: Request, num_tokens: int, plan: EncoderPlan) -> None:
        self.sched.grant(step, request, num_tokens, plan)  # charges its predicted cost to the step
        self._last_served[request.request_id] = self._now

    def _room_for_batch(self, request: Request) -> bool:
        """Admit batch work only if its whole remaining prompt fits and still leaves a block for each
        running chat to grow: admitting less just sets up its own eviction (recompute thrash)."""
        sched = self.sched
        need = -(-(request.num_tokens - request.num_computed_tokens) // sched.kv.block_size)
        chats = sum(1 for r in sched.running if r.service_class == INTERACTIVE)
        return sched.kv.num_free_blocks - need >= chats

    # -- preemption ----------------------------------------------------------------------------------
    def _victim(self, requester: Request, admitting: bool) -> Request | None:
        """Whom `requester` may evict: a running request of its own class or lower (strictly lower
        when it is being admitted). The requester itself counts when it is running, and is chosen
        when it ranks first (then it is preempted rather than someone more protected). A pinned
        request is shielded from its own class only: a chat takes a pinned batch job's blocks
        rather than another chat's."""
        now = self._now

        def pinned(v: Request) -> bool:
            return self._pinned_until.get(v.request_id, -math.inf) > now

        if admitting:
            allowed = [v for v in self.sched.running if v.service_class > requester.service_class]
        else:
            allowed = [v for v in self.sched.running if v.service_class >= requester.service_class]
        free = [v for v in allowed if not pinned(v)]
        victim = max(free, key=self._victim_rank, default=None)
        if victim is None or victim.service_class == requester.service_class:
            lower_pinned = [v for v in allowed if pinned(v) and v.service_class > requester.service_class]
            victim = max(lower_pinned, key=self._victim_rank, default=victim)
        if victim is None:
            return None
        same_class = victim.service_class == requester.service_class
        if not admitting and same_class and self._victim_rank(victim) < self._victim_rank(requester):
            return None  # pinned itself, and everyone else is more protected: it waits instead
        return victim

    def _victim_rank(self, request: Request) -> tuple[int, float, int]:
        """Larger is evicted first: batch prefills, batch decodes, late interactive prefills,
        interactive prefills with the most slack; interactive decodes last (latest arrival first)."""
        decode = request.is_decoding
        if request.service_class == BATCH:
            return (3 if decode else 4), 0.0, request.arrival_seq
        if decode:
            return 0, 0.0, request.arrival_seq
        tier, slack, seq = self.prefill_key(request)
        if tier != Tier.FEASIBLE:
            return 2, 0.0, seq
        return 1, slack, seq

    def _preempt(self, step: _Step, victim: Request) -> None:
        sched = self.sched
        sched.preempt(step, victim)  # returns the victim's grant and its predicted cost to the step
        if victim.num_preemptions >= self.config.pin_after_preemptions:
            self._pinned_until[victim.request_id] = self._now + self.config.pin_ms / 1e3

    def _forget_finished(self) -> None:
        live = self.sched.requests
        for table in (self._skips, self._pinned_until, self._last_served):
            for request_id in [rid for rid in table if rid not in live]:
                del table[request_id]
