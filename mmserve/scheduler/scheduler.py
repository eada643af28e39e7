"""The token-budget scheduler: grants each request some tokens per step, allocates their KV
blocks, preempts by recompute when blocks run out, and applies sampled tokens. Torch-free.

There are no prefill/decode phases: a request has `num_computed_tokens` and `num_tokens`, and a
step grants it up to the difference (a decode is a grant of one token). Which requests get tokens
is the policy's: fcfs / priority / no_chunk / static are planned here, `slo` by `slo.SloPlanner`.
Time comes from an injectable clock, so tests drive the scheduler with a virtual one.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from mmserve.config import CacheConfig, KVTransferConfig, SchedulerConfig
from mmserve.errors import InvalidRequestError, PromptTooLongError
from mmserve.request import KVTransferParams, Request, RequestStatus, ServiceClass
from mmserve.scheduler.encoder_cache import EncoderCacheManager, EncoderGrant, EncoderKey, new_encoder_tokens
from mmserve.scheduler.kv_cache_manager import KVCacheManager
from mmserve.scheduler.kv_events import KVCacheEvent
from mmserve.scheduler.kv_transfer import KVTransferScheduler
from mmserve.scheduler.output import (
    EncoderWork,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    encoder_work_tokens,
)
from mmserve.scheduler.policy import get_policy
from mmserve.scheduler.slo import SloPlanner
from mmserve.scheduler.step_time import StepFeatures, StepTimeModel, StepTimeStats

# Under a time limit, the first prefill of a step may take at least this share of the planned step time
# even when the decodes fill it (and its next piece, one token or one encoder group, if even that is too
# little): when the decodes alone exceed the target the target is lost anyway, and a prefill that got
# nothing would starve new requests (their TTFT) for as long as anyone decodes.
PREFILL_FLOOR_SHARE = 0.25


@dataclass(frozen=True)
class SchedulerStats:
    num_total_blocks: int
    num_free_blocks: int  # blocks no request holds, cached or not
    peak_num_used_blocks: int  # most blocks held at once since start
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    encoder_cache_hits: int  # embedding tokens served from the encoder cache
    num_encoder_tokens_computed: int  # embedding tokens the encoder computed
    num_encoder_tokens_loaded: int = 0  # embedding tokens loaded from an encoder instance's output instead
    num_referenced_encoder_tokens: int = 0  # encoder-cache tokens some live request still needs
    num_encoder_cache_entries: int = 0  # (mm_hash, group) entries cached, referenced or not
    num_partial_encodes: int = 0  # groups part-way through the vision tower (encoded in slices of its blocks)
    num_encoder_slices: int = 0  # slices of the tower's blocks planned (a group spread over several steps)
    # Per service class (every policy counts them; only `slo` acts on classes).
    num_preemptions_interactive: int = 0
    num_preemptions_batch: int = 0
    num_throttled_batch_decodes: int = 0  # `slo`: steps a running batch decode was skipped
    num_downgraded_requests: int = 0  # `slo` admission control: interactive requests run as batch
    num_rejected_requests: int = 0  # `slo` admission control: interactive requests refused (429)
    # Disaggregation: requests whose prompt KV is being read from a prefill instance (counted in num_waiting
    # too), finished requests whose blocks wait for a decode instance, and the reads so far.
    num_loading_remote_kv: int = 0
    num_kv_leases: int = 0
    num_kv_loads_done: int = 0
    num_kv_loads_failed: int = 0
    num_kv_leases_expired: int = 0
    num_kv_blocks_read: int = 0  # blocks read from prefill instances (every layer's K and V of each)
    kv_read_s: float = 0.0  # wall seconds of those reads, summed
    step_time: StepTimeStats | None = None  # the step-time model against the measured steps

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass
class _Step:
    """What one `schedule()` call has decided so far."""

    budget: int  # tokens left
    encoder_budget: int  # embedding tokens the encoder may still compute
    grants: dict[str, int] = field(default_factory=dict)  # request id -> tokens, in batch order
    charges: dict[str, int] = field(default_factory=dict)  # request id -> budget its encoding took
    encoder_work: list[EncoderWork] = field(default_factory=list)
    # Encoder-cache references to drop once the plan is complete; key None drops all of a request's.
    releases: list[tuple[str, EncoderKey | None]] = field(default_factory=list)
    # Predicted seconds the step may still add (math.inf: no time limit), the planned limit itself, the
    # predicted cost of each grant (returned on preemption), and whether a prefill got tokens yet.
    seconds_left: float = math.inf
    time_limit: float = math.inf
    costs: dict[str, float] = field(default_factory=dict)
    prefill_served: bool = False
    slice_served: bool = False  # a grant of no tokens ran a slice of a group's encode (it runs even if preempted)

    def encodes(self, key: EncoderKey) -> bool:
        """Whether this step already has encoder work (a whole group or a slice) for the group `key`."""
        return any((w.mm_input.mm_hash, w.group) == key for w in self.encoder_work)

    def limit_time(self, limit: float, intercept: float) -> None:
        """Plan this step to `limit` predicted seconds (math.inf: none)."""
        self.time_limit = limit
        self.seconds_left = limit - intercept


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        step_time_model: StepTimeModel | None = None,
        kv_transfer: tuple[KVTransferConfig, str] | None = None,
        encoder_outputs: Callable[[EncoderKey], bool] | None = None,
        encode_only: bool = False,
        encoder_depth: int = 0,
    ) -> None:
        """`kv_transfer`: disaggregation's configuration and this instance's engine id; None: off.
        `encoder_outputs`: whether an encoder instance has stored a group's embeddings for this one to load
        (encoder disaggregation); None: every group not cached is encoded here. `encode_only` (an encoder
        instance): requests get their media encoded and end, with no tokens and no KV. `encoder_depth`: the
        vision tower's blocks, when the runner can encode a group in slices of them (a group that does not fit
        a step's time is then spread over several); 0: every group is encoded whole."""
        self.config = scheduler_config
        self.policy = get_policy(scheduler_config.policy)
        self.clock = clock  # seconds; the same clock as Request.arrival_time
        if step_time_model is None:
            path = scheduler_config.step_time_model
            step_time_model = StepTimeModel.load(path) if path is not None else StepTimeModel()
        self.step_time = step_time_model  # corrected online by record_step_time()
        self.kv = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.enable_kv_events,
        )
        self.encoder_cache = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self._encoder_outputs = encoder_outputs
        self.encode_only = encode_only
        self.encoder_depth = encoder_depth
        self.num_encoder_slices = 0
        self._encoded: list[Request] = []  # encode-only requests whose last groups the current plan encodes
        self.kv_transfer: KVTransferScheduler | None = None
        if kv_transfer is not None:
            self.kv_transfer = KVTransferScheduler(*kv_transfer, cache_config.block_size, clock)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by policy.sort_key
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_preemptions_by_class: dict[ServiceClass, int] = dict.fromkeys(ServiceClass, 0)
        # The `slo` policy plans steps itself, through the primitives below.
        self.slo: SloPlanner | None = SloPlanner(self) if self.policy.slo_aware else None
        self._arrival_seq = itertools.count()
        self._finished_ids: set[str] = set()  # since the last plan
        self._preempted_ids: set[str] = set()
        # What the runner has been sent of each running request: (token ids, block ids). A request
        # absent here is sent whole (NewRequestData) the next time it is scheduled.
        self._sent: dict[str, tuple[int, int]] = {}
        self._held: set[str] = set()  # waiting requests not to be scheduled yet (their grammar compiles)
        # n > 1: request id -> the waiting requests that share its prompt KV once its prefill is done.
        self._forks: dict[str, list[Request]] = {}

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request_id {request.request_id!r} is already in use", param="request_id"
            )
        n = request.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
        if n >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt: {n} tokens leave no room for output within max_model_len={self.config.max_model_len}",
                param="prompt",
            )
        if not self.policy.chunked_prefill and n > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt: {n} tokens exceed max_num_batched_tokens={self.config.max_num_batched_tokens}, "
                f"and policy {self.policy.name!r} does not chunk prefills",
                param="prompt",
            )
        self._check_kv_transfer(request)
        if self.slo is not None:
            self.slo.admit(request, self.clock())  # may downgrade it to batch, or raise SloInfeasibleError
        request.arrival_seq = next(self._arrival_seq)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        parent = self.requests.get(request.prefill_from) if request.prefill_from is not None else None
        if parent is not None and not parent.num_output_tokens:
            self._forks.setdefault(parent.request_id, []).append(request)
        self._enqueue_waiting(request)

    def _check_kv_transfer(self, request: Request) -> None:
        params = request.sampling_params.kv_transfer
        if params is None or not (params.do_remote_decode or params.do_remote_prefill):
            return
        if self.kv_transfer is None:
            raise InvalidRequestError(
                "kv_transfer_params: this server does not disaggregate (start it with --kv-transfer-config)",
                param="kv_transfer_params",
            )
        role = self.kv_transfer.config.kv_role
        if params.do_remote_decode and not self.kv_transfer.config.is_producer:
            raise InvalidRequestError(
                f"kv_transfer_params.do_remote_decode: this instance's kv_role is {role!r}", param="kv_transfer_params"
            )
        if params.do_remote_prefill and not self.kv_transfer.config.is_consumer:
            raise InvalidRequestError(
                f"kv_transfer_params.do_remote_prefill: this instance's kv_role is {role!r}", param="kv_transfer_params"
            )
        if request.sampling_params.n > 1:
            raise InvalidRequestError("kv_transfer_params: a disaggregated request samples n=1", param="n")
        if params.do_remote_prefill:
            mismatch = self.kv_transfer.remote_blocks_mismatch(request)
            if mismatch is not None:  # a prefill instance with another tokenizer, template or block size
                raise InvalidRequestError(
                    f"kv_transfer_params.remote_block_ids: {mismatch}", param="kv_transfer_params.remote_block_ids"
                )

    def hold(self, request_id: str) -> None:
        """Keep a waiting request out of the plans until `release` (e.g. while its grammar compiles)."""
        if request_id in self.requests:
            self._held.add(request_id)

    def release(self, request_id: str) -> None:
        self._held.discard(request_id)

    def admissible_waiting(self) -> Iterator[Request]:
        """The waiting requests that may be admitted now, in policy order: not held, and not a fork
        whose parent is still computing the prompt they share. Lazy, over a snapshot of the queue
        (admitting removes from it), so a caller that stops early looks at no more than it needs."""
        for request in tuple(self.waiting):
            if request.request_id not in self._held and not self._awaits_fork(request):
                yield request

    def _awaits_fork(self, request: Request) -> bool:
        return request.prefill_from is not None and request in self._forks.get(request.prefill_from, ())

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """End a request from outside (abort, stop string). False if it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status)
        return True

    def preempted_since_last_plan(self, request_id: str) -> bool:
        """Preempted in the step being planned (or since the last plan): not readmitted in the same step."""
        return request_id in self._preempted_ids

    def fail_requests(self, request_ids: Iterable[str], message: str) -> list[EngineCoreOutput]:
        """The engine failed these requests: free everything they hold; one error output each."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(request_id, (), None, RequestStatus.FINISHED_ERROR.finish_reason, error=message)
            )
        return outputs

    def fail_step(self, request_ids: Iterable[str], message: str) -> list[EngineCoreOutput]:
        """A step failed on the device. Its KV writes and encoder outputs are indeterminate, so no block
        hash or encoder entry is trusted any more: fail the step's requests and every request part-way
        into its media (its encoder entries are gone). The others keep their KV (the step never wrote
        it) and go on."""
        self.forget_cached_state()
        victims = set(request_ids)
        for request_id, request in self.requests.items():
            media_end = max((m.placeholder.offset + m.placeholder.length for m in request.mm_inputs), default=0)
            if 0 < request.num_computed_tokens < media_end:
                victims.add(request_id)
        return self.fail_requests(sorted(victims), message)

    def forget_cached_state(self) -> None:
        """After a step failed on the device, no block hash or encoder entry can be trusted: the
        step's KV and encoder outputs may not have been written. The caller aborts its requests."""
        self.kv.reset_prefix_cache()
        self.encoder_cache.reset()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What entered and left the prefix cache since the last call, in order (empty unless enabled)."""
        return self.kv.take_events()

    def kv_snapshot_events(self) -> list[KVCacheEvent]:
        """The whole prefix cache as events, for a subscriber that joined late (empty unless enabled)."""
        return self.kv.snapshot_events()

    def request_ids(self) -> list[str]:
        """Every request the scheduler holds (waiting or running)."""
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_kv_transfers(self) -> bool:
        """Reads or leases the workers must keep reporting on (disaggregation), also while nothing runs."""
        return self.kv_transfer is not None and self.kv_transfer.has_pending()

    def has_unsent_diffs(self) -> bool:
        """Requests finished or preempted since the last plan: the next plan tells the runner."""
        return bool(self._finished_ids or self._preempted_ids or self.encoder_cache.has_pending_evictions())

    def encoder_entries_unaccounted(self, keys: Iterable[EncoderKey]) -> tuple[int, int]:
        """Of the runner's encoder entries `keys`: (not in the encoder cache, still referenced). Both
        are 0 once every request has finished."""
        keys = list(keys)
        cache = self.encoder_cache
        not_cached = sum(1 for k in keys if not cache.is_cached(k) and not cache.is_partial(k))
        referenced = sum(1 for k in keys if self.encoder_cache.is_cached(k) and self.encoder_cache.is_referenced(k))
        return not_cached, referenced

    def record_step_time(self, features: StepFeatures, duration_s: float) -> None:
        """Engine feedback: the measured wall time of the step whose plan has these features."""
        self.step_time.observe(features, duration_s)

    def stats(self) -> SchedulerStats:
        slo = self.slo.counters if self.slo is not None else None
        kv = self.kv_transfer
        return SchedulerStats(
            num_total_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            peak_num_used_blocks=self.kv.peak_num_used_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + (len(kv.loading) if kv is not None else 0),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            encoder_cache_hits=self.encoder_cache.num_hit_tokens,
            num_encoder_tokens_computed=self.encoder_cache.num_computed_tokens,
            num_encoder_tokens_loaded=self.encoder_cache.num_loaded_tokens,
            num_referenced_encoder_tokens=self.encoder_cache.num_referenced_tokens,
            num_encoder_cache_entries=self.encoder_cache.num_entries,
            num_partial_encodes=self.encoder_cache.num_partial,
            num_encoder_slices=self.num_encoder_slices,
            num_preemptions_interactive=self.num_preemptions_by_class[ServiceClass.INTERACTIVE],
            num_preemptions_batch=self.num_preemptions_by_class[ServiceClass.BATCH],
            num_throttled_batch_decodes=slo.throttled_batch_decodes if slo is not None else 0,
            num_downgraded_requests=slo.downgraded if slo is not None else 0,
            num_rejected_requests=slo.rejected if slo is not None else 0,
            step_time=self.step_time.stats(),
            num_loading_remote_kv=len(kv.loading) if kv is not None else 0,
            num_kv_leases=kv.num_leases if kv is not None else 0,
            num_kv_loads_done=kv.num_loads_done if kv is not None else 0,
            num_kv_loads_failed=kv.num_loads_failed if kv is not None else 0,
            num_kv_leases_expired=kv.num_leases_expired if kv is not None else 0,
            num_kv_blocks_read=kv.num_blocks_read if kv is not None else 0,
            kv_read_s=kv.read_s if kv is not None else 0.0,
        )

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens, self.config.max_num_encoder_tokens)
        self.encoder_cache.begin_plan()
        if self.kv_transfer is not None:
            for request in self.kv_transfer.expired():  # no decode instance read them in time
                self.kv.free(request)
            self._start_remote_loads()  # they take blocks, no budget: before any policy plans the step
        if self.encode_only:
            self._schedule_encodes(step)
        elif self.slo is not None:
            self.slo.fill(step, self.clock())
        else:
            if self.policy.prefill_first:
                self._schedule_waiting(step)
            if not step.grants:
                if self.policy.chunked_prefill and any(r.is_decoding for r in self.running):
                    step.limit_time(self.step_time_limit(), self.step_time.intercept())
                preempted = self._schedule_running(step)
                if not preempted and not self.policy.prefill_first:
                    self._schedule_waiting(step)

        scheduled = []
        new_requests = []
        for request_id, num_new_tokens in step.grants.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new_tokens
            sent = self._sent.get(request_id)
            if sent is None:
                new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        prompt_token_ids=tuple(request.prompt_token_ids),
                        sampling_params=request.sampling_params,
                        mm_inputs=tuple(request.mm_inputs),
                        mrope_positions=request.mrope_positions,
                        mrope_delta=request.mrope_delta,
                    )
                )
                sent = (request.num_prompt_tokens, 0)
            num_tokens_sent, num_blocks_sent = sent
            block_ids = self.kv.block_ids(request_id)
            scheduled.append(
                ScheduledRequest(
                    request_id=request_id,
                    num_computed_tokens=start,
                    num_scheduled_tokens=num_new_tokens,
                    new_token_ids=tuple(request.all_token_ids[num_tokens_sent:end]),
                    new_block_ids=tuple(block_ids[num_blocks_sent:]),
                    sample=end == request.num_tokens,
                    is_decode=request.is_decoding,
                )
            )
            self._sent[request_id] = (max(num_tokens_sent, end), len(block_ids))
            # Advanced now, so that a chunked prefill's next chunk can be planned next step.
            request.num_computed_tokens = end
            # Groups whose every token is now planned are no longer needed by this request (unless the
            # same item appears again later in the prompt). Only prefill steps hold any.
            held = self.encoder_cache.held_keys(request_id)
            if held:
                still_needed = {
                    (mm.mm_hash, g)
                    for mm in request.mm_inputs
                    for g in range(mm.num_groups)
                    if mm.group_range(g)[1] > end
                }
                step.releases.extend((request_id, key) for key in held if key not in still_needed)
        # Released only now, so that requests later in this plan could still share the entries.
        for request_id, key in step.releases:
            if key is None:
                self.encoder_cache.release_all(request_id)
            else:
                self.encoder_cache.release(request_id, key)
        plan = SchedulerOutput(
            scheduled=tuple(scheduled),
            num_scheduled_tokens=sum(step.grants.values()),
            new_requests=tuple(new_requests),
            encoder_work=tuple(step.encoder_work),
            freed_encoder_keys=tuple(self.encoder_cache.take_evicted()),  # dropped before encoding
            finished_request_ids=frozenset(self._finished_ids),
            preempted_request_ids=frozenset(self._preempted_ids),
            kv_loads=self.kv_transfer.take_new_loads() if self.kv_transfer is not None else (),
            kv_transfers_pending=self.has_pending_kv_transfers(),
        )
        self._finished_ids.clear()
        self._preempted_ids.clear()
        return plan

    def update(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens and finish requests that stop. One output per sampled request."""
        outputs = self._apply_kv_transfers(runner_output) if self.kv_transfer is not None else []
        encoded, self._encoded = self._encoded, []
        for request in encoded:  # an encoder instance's request: its media are encoded (and stored)
            if request.request_id in self.requests:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                outputs.append(EngineCoreOutput(request.request_id, (), None, "length",
                                                first_scheduled_time=request.first_scheduled_time))  # fmt: skip
        for failed in runner_output.failed:  # left out of the step by the runner: they fail alone
            request = self.requests.get(failed.request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                # What its KV really holds, so that freeing it unpublishes the blocks never written.
                request.num_computed_tokens = failed.num_computed_tokens
            outputs += self.fail_requests([failed.request_id], "the request failed inside the engine")
        now = self.clock()
        for request_id, token_id, logprobs in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, runner_output.logprobs, strict=True
        ):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted after this plan was made; its token is dropped
            request.append_output_token(token_id)
            request.last_token_time = now
            if request.first_token_time is None:
                request.first_token_time = now
            for child in self._forks.pop(request_id, ()):  # its prompt KV is written: share it
                self.kv.fork(request, child)
            status = self._check_stop(request, token_id)
            kv_transfer_params = None
            if status is not None:
                kv_transfer_params = self._finish(request, status, hand_over=True)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=(token_id,),
                    new_logprobs=(logprobs,) if logprobs is not None else None,
                    finish_reason=status.finish_reason if status is not None else None,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    first_scheduled_time=request.first_scheduled_time,
                    service_class=int(request.service_class),
                    kv_transfer_params=kv_transfer_params,
                )
            )
        return outputs

    def _apply_kv_transfers(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """What the workers report of disaggregation: decode instances that read a finished request's blocks
        (they may go now), and reads into this instance that ended, well or not."""
        kv = self.kv_transfer
        assert kv is not None
        kv.num_blocks_read += runner_output.kv_blocks_read
        kv.read_s += runner_output.kv_read_s
        for request_id in runner_output.kv_sends_done:
            request = kv.release(request_id)
            if request is not None:
                self.kv.free(request)
        failed_ids = set(runner_output.kv_loads_failed)
        outputs: list[EngineCoreOutput] = []
        for request_id in (*runner_output.kv_loads_done, *runner_output.kv_loads_failed):
            request, orphaned = kv.end_load(request_id)
            if request is None:
                continue
            if orphaned:  # it finished meanwhile: its blocks were kept only for the read
                self.kv.free(request)
                continue
            if request_id not in failed_ids:
                kv.num_loads_done += 1
                # Every prompt token but the last is in the KV cache; computing that one gives the logits.
                request.num_computed_tokens = request.num_prompt_tokens - 1
                self.kv.publish_computed(request, request.num_computed_tokens)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                continue
            kv.num_loads_failed += 1
            kv.prefill_here(request)  # never read again (nor told to free: the read failed)
            if kv.config.kv_load_failure_policy == "fail":
                request.status = RequestStatus.WAITING  # so that failing it takes it from the waiting queue
                self._enqueue_waiting(request)
                outputs += self.fail_requests(
                    [request_id], "reading the prompt's KV cache from the prefill instance failed"
                )
            else:  # recompute: prefill it here, from whatever the local prefix cache holds
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self._enqueue_waiting(request)
        return outputs

    # -- internals -----------------------------------------------------------------------------------
    def _schedule_running(self, step: _Step) -> bool:
        """Grant running requests tokens, decodes before partial prefills. Returns whether it preempted."""
        preempted = False
        # Stable sort: decodes (one token left) first, each group in admission order.
        for request in sorted(self.running, key=lambda r: not r.is_decoding):
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            max_tokens = min(request.num_tokens - start, step.budget)
            if request.is_decoding:  # a decode's token is never refused for time
                num_new_tokens, encoder_plan = self.plan_encoder(request, start, max_tokens, step)
            else:
                num_new_tokens, encoder_plan = self.fit_prefill(step, request, start, max_tokens)
            if num_new_tokens <= 0:
                self.grant(step, request, 0, encoder_plan)  # a slice of its next group's encode, if any
                continue  # its last sampled token is not applied yet, the encoder budget or the time is spent
            while self.kv.allocate_slots(request, num_new_tokens) is None:
                victim = self.policy.pick_victim(self.running)
                self.preempt(step, victim)
                preempted = True
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                self.grant(step, request, num_new_tokens, encoder_plan)
        return preempted

    def _schedule_waiting(self, step: _Step) -> None:
        if not self.policy.admit_while_running and self.running:
            return
        for request in self.admissible_waiting():
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached
            # Whole prefills only; but a preempted request's prompt + outputs may outgrow the budget,
            # so its recompute is chunked rather than never admitted again.
            if (
                not self.policy.chunked_prefill
                and num_new_tokens > step.budget
                and not request.num_preemptions
            ):
                break
            num_new_tokens, encoder_plan = self.fit_prefill(
                step, request, num_cached, min(num_new_tokens, step.budget)
            )
            if num_new_tokens <= 0:
                break
            if self.kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break
            self.start_running(request, num_cached)
            self.grant(step, request, num_new_tokens, encoder_plan)

    def _schedule_encodes(self, step: _Step) -> None:
        """An encoder instance's step: the waiting requests' media groups in policy order, within the encoder
        budget and the cache's room (a group bigger than either runs alone). Groups cached or already stored
        are not encoded again. A request whose every group is planned ends with this step."""
        self._encoded = []
        for request in self.admissible_waiting():
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            for mm in request.mm_inputs:
                for group in range(mm.num_groups):
                    key, tokens = (mm.mm_hash, group), mm.tokens_per_group
                    if self.encoder_cache.holds(request.request_id, key):
                        continue
                    if self.encoder_cache.is_cached(key):
                        self.encoder_cache.share(request.request_id, key)
                        continue
                    if self._encoder_outputs is not None and self._encoder_outputs(key):
                        continue  # stored already (by this instance or another)
                    budget, room = step.encoder_budget, self.encoder_cache.room()
                    if (tokens > budget and budget < self.config.max_num_encoder_tokens) or (
                        tokens > room and room < self.encoder_cache.capacity
                    ):
                        return
                    self.encoder_cache.add(request.request_id, key, tokens)
                    step.encoder_budget -= tokens
                    step.encoder_work.append(EncoderWork(mm, group))
            self._encoded.append(request)

    def _start_remote_loads(self) -> None:
        """Admit the waiting requests prefilled remotely, in policy order while blocks and max_num_seqs last:
        blocks for the whole prompt (local prefix hits first); the rest is read from the prefill instance."""
        assert self.kv_transfer is not None
        for request in self.admissible_waiting():
            if not self.kv_transfer.wants_load(request):
                continue
            if len(self.running) + len(self.kv_transfer.loading) >= self.config.max_num_seqs:
                return
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            if not self._start_remote_load(request, computed_blocks, num_cached):
                return

    def _start_remote_load(self, request: Request, computed_blocks: list[int], num_cached: int) -> bool:
        """Hashes of the blocks read are published once the read ends. False if the blocks run out."""
        assert self.kv_transfer is not None
        num_new_tokens = request.num_prompt_tokens - num_cached
        if self.kv.allocate_slots(request, num_new_tokens, computed_blocks, publish=False) is None:
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_cached  # what its blocks hold until the read ends
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            request.first_scheduled_time = self.clock()
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        self.kv_transfer.start_load(request, self.kv.block_ids(request.request_id), len(computed_blocks))
        return True

    def start_running(self, request: Request, num_cached: int) -> None:
        """Move an admitted request (its blocks just allocated) from waiting to running."""
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            request.first_scheduled_time = self.clock()
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)

    def step_time_limit(self, target_s: float = math.inf) -> float:
        """Predicted seconds a step that carries running decodes is planned to: the tighter of `target_s`
        (the slo policy's TBT) and max_step_ms, less the headroom, divided by the step-time model's
        measured error factor (so the margin widens while predictions miss). math.inf: no limit."""
        if self.config.max_step_ms is not None:
            target_s = min(target_s, self.config.max_step_ms / 1e3)
        if target_s == math.inf:
            return math.inf
        return target_s * (1.0 - self.config.step_time_headroom) / self.step_time.error_factor()

    def fit_prefill(self, step: _Step, request: Request, start: int, max_tokens: int) -> tuple[int, list[EncoderGrant]]:
        """A prefill chunk from `start` (at most `max_tokens`) within the step's time left, with its encoder
        plan. Without a time limit: what the budgets allow. The step's first prefill gets at least
        PREFILL_FLOOR_SHARE of the limit, and if that is still too little, its next piece (`next_unit`)."""
        if step.seconds_left == math.inf:
            return self.plan_encoder(request, start, max_tokens, step)
        seconds = step.seconds_left
        if not step.prefill_served:
            seconds = max(seconds, PREFILL_FLOOR_SHARE * step.time_limit)
        n, plan = self.fit_to_time(step, request, start, max_tokens, seconds)
        if n <= 0 and not plan and not step.prefill_served:
            piece = self.encoder_slice(step, request, start, seconds, True) if self.is_admitted(request) else None
            if piece is not None:
                return 0, [piece]
            unit = min(self.next_unit(request, start, whole_group=True), max_tokens)
            n, plan = self.plan_encoder(request, start, unit, step) if unit > 0 else (0, [])
        return n, plan

    def fit_to_time(
        self, step: _Step, request: Request, start: int, max_tokens: int, seconds: float
    ) -> tuple[int, list[EncoderGrant]]:
        """The most tokens from `start` (at most `max_tokens`) whose predicted cost, the encoder groups
        they need included, fits `seconds`; with their encoder plan. A chunk that cannot take a group it
        reaches ends right before it (its text before the group still fits); the time left then runs a slice
        of that group's encode, when the runner encodes in slices (`encoder_slice`): the plan ends with it."""
        model = self.step_time
        n = min(max_tokens, model.tokens_within(seconds, start))
        while n > 0:
            n, plan = self.plan_encoder(request, start, n, step)
            if n <= 0:
                break
            encoder_tokens = new_encoder_tokens(plan)
            cost = model.grant_cost(start, n, encoder_tokens)
            if cost <= seconds:
                piece = None
                if n < max_tokens:
                    piece = self.encoder_slice(step, request, start + n, seconds - cost, planned=plan)
                return n, [*plan, piece] if piece is not None else plan
            # Fewer text tokens with the same groups; if the groups alone do not fit, end before the last one.
            fewer = min(n - 1, model.tokens_within(seconds, start, encoder_tokens))
            new_groups = [g.mm.group_range(g.group)[0] for g in plan if not g.cached]
            if fewer <= 0 and new_groups:
                fewer = min(n - 1, max(new_groups) - start)
            n = fewer
        piece = self.encoder_slice(step, request, start, seconds) if max_tokens > 0 and self.is_admitted(request) else None
        return 0, [piece] if piece is not None else []

    @staticmethod
    def is_admitted(request: Request) -> bool:
        """Whether a grant of no tokens (a slice of a group's encode alone) may go to the request: only to a running
        one. A waiting request holds no KV blocks; encoder work (and cache room) for it would run ahead of its
        admission, and a failing slice would not be blamed on it (the failed step names the requests it ran)."""
        return request.status == RequestStatus.RUNNING

    def encoder_slice(
        self,
        step: _Step,
        request: Request,
        position: int,
        seconds: float,
        at_least_one: bool = False,
        planned: list[EncoderGrant] | tuple[()] = (),
    ) -> EncoderGrant | None:
        """A slice of the tower's blocks for the group that prompt token `position` stands in, when it is not
        encoded yet and its encode does not fit this step: as many blocks as `seconds` allows (`at_least_one`:
        never none, so the request moves). None: no slicing here, nothing to slice, or not one block fits.
        `planned`: the groups the request's chunk in this step already has (not granted yet).
        A slice that reaches the tower's last block completes the group (it is then cached)."""
        depth = self.encoder_depth
        if not depth or not (self.policy.chunked_prefill and self.config.chunk_encoder):
            return None
        for mm in request.mm_inputs:
            first, last = mm.placeholder.offset, mm.placeholder.offset + mm.placeholder.length
            if first <= position < last:
                break
        else:
            return None
        group = (position - first) // mm.tokens_per_group
        key = (mm.mm_hash, group)
        if (
            self.encoder_cache.is_cached(key)
            or step.encodes(key)
            or any((g.mm.mm_hash, g.group) == key for g in planned)
            or (self._encoder_outputs is not None and self._encoder_outputs(key))
        ):
            return None  # cached, already worked on in this step, or an encoder instance's to load
        done = self.encoder_cache.blocks_done(key)
        tokens = mm.tokens_per_group
        per_block = self.step_time.encoder_cost(tokens / depth)
        if per_block <= 0 or seconds == math.inf:
            blocks = depth - done
        else:
            blocks = min(depth - done, int(seconds / per_block)) if seconds > 0.0 else 0  # NaN: none
        # What the step's encoder budget has room for, after the groups planned beside it.
        encoder_budget = step.encoder_budget - sum(math.ceil(g.num_tokens_computed) for g in planned)
        budget_blocks = max(0, encoder_budget) * depth // tokens
        blocks = min(blocks, budget_blocks)
        if blocks <= 0 and at_least_one and encoder_budget == self.config.max_num_encoder_tokens:
            blocks = 1  # the step's forced piece: a block bigger than the whole budget runs alone, as a group may
        if blocks <= 0:
            return None
        if done + blocks == depth:  # completes the group: a cache entry, with the room any entry needs
            cache = self.encoder_cache
            room = cache.room() - sum(
                g.mm.tokens_per_group
                for g in planned
                if not g.cached or not cache.is_referenced((g.mm.mm_hash, g.group))  # shared: no longer evictable
            )
            if tokens > room and room < self.encoder_cache.capacity:
                return None
        return EncoderGrant(mm, group, cached=False, charge=0, blocks=(done, done + blocks, depth))

    def next_unit(self, request: Request, start: int, whole_group: bool) -> int:
        """The smallest grant from `start`: to the end of the encoder group `start` stands in, if that
        group is not encoded yet (0 unless `whole_group`), else one token."""
        for mm in request.mm_inputs:
            first, last = mm.placeholder.offset, mm.placeholder.offset + mm.placeholder.length
            if first <= start < last:
                group = (start - first) // mm.tokens_per_group
                if self.encoder_cache.is_cached((mm.mm_hash, group)):
                    return 1  # already encoded: its tokens cost what text costs
                return mm.group_range(group)[1] - start if whole_group else 0
        return 1

    def plan_encoder(
        self, request: Request, start: int, num_new_tokens: int, step: _Step
    ) -> tuple[int, list[EncoderGrant]]:
        """Decide the encoder work that tokens [start, start + num_new_tokens) need, without changing
        anything. Returns the (possibly shortened) grant and the groups it needs.

        A temporal group not yet in the encoder cache is encoded this step if the encoder budget
        and the cache have room; otherwise the chunk ends right before that group. Without encoder
        chunking, an item's groups are all encoded in the step its placeholder is first reached.
        With `encoder_token_cost`, each group encoded also takes ceil(cost x its tokens) of the step's
        token budget, so the chunk shrinks. A group whose charge does not fit is left for the next step
        (the chunk ends before it); a chunk that starts at such a group pays what is left less one token,
        so it never starves.
        """
        end = start + num_new_tokens
        plan: list[EncoderGrant] = []
        planned: set[tuple[str, int]] = set()
        budget = step.encoder_budget
        room = self.encoder_cache.room()
        limited = self.policy.chunked_prefill  # the no-chunk baselines encode whole prompts at once
        cost = self.config.encoder_token_cost if limited and self.config.chunk_encoder else 0.0
        charged = 0  # budget tokens the planned groups' encoding takes
        for mm in request.mm_inputs:
            first, last = mm.placeholder.offset, mm.placeholder.offset + mm.placeholder.length
            if last <= start or first >= end:
                continue
            tokens = mm.tokens_per_group
            item_budget = budget
            first_group = (max(start, first) - first) // tokens  # earlier groups are in the KV cache
            last_group = (
                (min(end, last) - 1 - first) // tokens if self.config.chunk_encoder else mm.num_groups - 1
            )
            groups = range(first_group, last_group + 1)
            for group in groups:
                key = (mm.mm_hash, group)
                if key in planned or self.encoder_cache.holds(request.request_id, key):
                    continue
                group_start = max(0, mm.group_range(group)[0] - start)
                cached = self.encoder_cache.is_cached(key)
                if not cached and step.encodes(key):
                    # A slice of it runs in this step already (another request's): its tokens wait for the rest.
                    return min(num_new_tokens, group_start, step.budget - charged), plan
                done = self.encoder_cache.blocks_done(key)  # a group encoded in slices: the rest of the tower
                blocks = (done, self.encoder_depth, self.encoder_depth) if done else None
                # Stored by an encoder instance: loaded into the cache, so it takes room but no encoder time.
                loaded = not cached and not done and self._encoder_outputs is not None and self._encoder_outputs(key)
                charge = 0 if cached or loaded else math.ceil(cost * tokens)
                # With a cost, the chunk must still reach one token into the group after the charges.
                if cost and group_start + 1 + charge > step.budget - charged:
                    if group_start:  # prefill up to the group now; encode it next step, with room to charge
                        return min(num_new_tokens, group_start, step.budget - charged), plan
                    charge = max(0, step.budget - charged - 1)  # the chunk starts at the group: never starve it
                if cached and not self.encoder_cache.is_referenced(key):
                    room -= tokens  # once shared it can no longer be evicted to make room
                if not cached:
                    # Work bigger than the whole budget (a group, or an item without encoder chunking)
                    # may run alone in an otherwise encoder-free step.
                    alone = item_budget if not self.config.chunk_encoder else budget
                    work = math.ceil(encoder_work_tokens(tokens, blocks))  # a partial group: what is left of it
                    fits = loaded or work <= budget or alone == self.config.max_num_encoder_tokens
                    # Likewise the cache: an empty cache takes anything, so no group waits forever.
                    has_room = tokens <= room or room == self.encoder_cache.capacity
                    if limited and not (fits and has_room):
                        # End before this group; 0 if the chunk starts inside it (e.g. a prefix hit).
                        return min(num_new_tokens, group_start, step.budget - charged), plan
                    budget -= 0 if loaded else work
                    room -= tokens
                charged += charge
                plan.append(EncoderGrant(mm, group, cached, charge, loaded, blocks))
                planned.add(key)
        return min(num_new_tokens, step.budget - charged), plan

    def grant(
        self,
        step: _Step,
        request: Request,
        num_new_tokens: int,
        encoder_plan: list[EncoderGrant],
    ) -> None:
        """Give `request` `num_new_tokens` of this step with their encoder plan. 0 tokens: only the plan's slice
        of a group's encode (`encoder_slice`), if it has one; the request is then not in the step's batch."""
        encoder_tokens = new_encoder_tokens(encoder_plan)
        if num_new_tokens > 0:
            charge = sum(g.charge for g in encoder_plan)
            cost = self.step_time.grant_cost(request.num_computed_tokens, num_new_tokens, encoder_tokens)
            step.grants[request.request_id] = num_new_tokens
            step.charges[request.request_id] = charge
            step.budget -= num_new_tokens + charge
            step.costs[request.request_id] = cost
        elif encoder_plan:  # a slice runs even if the request is preempted later in this step: never returned
            cost = self.step_time.encoder_cost(encoder_tokens)
            step.slice_served = True
        else:
            return
        step.seconds_left -= cost
        step.prefill_served |= not request.is_decoding
        # Shares first: a new entry may evict unreferenced ones, never one this request is about to use.
        for grant in sorted(encoder_plan, key=lambda e: not e.cached):
            mm, group, cached, _, loaded, blocks = grant
            key = (mm.mm_hash, group)
            if cached:
                self.encoder_cache.share(request.request_id, key)
                continue
            if blocks is not None and blocks[1] < blocks[2]:  # a slice short of the tower's end: no entry yet
                self.encoder_cache.advance(request.request_id, key, blocks[1])
            else:
                self.encoder_cache.add(request.request_id, key, mm.tokens_per_group, loaded)
            step.encoder_budget -= math.ceil(grant.num_tokens_computed)
            step.encoder_work.append(EncoderWork(mm, group, load=loaded, blocks=blocks))
            self.num_encoder_slices += blocks is not None

    def preempt(self, step: _Step, request: Request) -> None:
        """Preemption by recompute: drop the request's KV and send it back to the waiting queue; what
        this step had granted it returns to the budget."""
        step.budget += step.grants.pop(request.request_id, 0) + step.charges.pop(request.request_id, 0)
        step.seconds_left += step.costs.pop(request.request_id, 0.0)
        # A preempted prefill's grant no longer counts: the next prefill gets the floor share again.
        # (Grants advance num_computed_tokens only when the plan is built, so is_decoding is still exact.)
        step.prefill_served = step.slice_served or any(not self.requests[rid].is_decoding for rid in step.grants)
        step.releases.append((request.request_id, None))
        self._sent.pop(request.request_id, None)
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_class[request.service_class] += 1
        self._preempted_ids.add(request.request_id)
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.policy.sort_key)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # Below min_tokens, EOS and stop tokens do not stop (the sampler bans them; this holds anyway).
        if request.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and token_id in request.eos_token_ids) or token_id in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, hand_over: bool = False) -> KVTransferParams | None:
        """End the request and free what it holds. `hand_over` (the engine ended it on a sampled token): a
        prefill instance's `do_remote_decode` request keeps its blocks for a decode instance instead, and
        this returns what to tell it (else None)."""
        kv_transfer = self.kv_transfer
        handed_over = None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            self.waiting.remove(request)
        if kv_transfer is not None and kv_transfer.orphan(request):
            pass  # a read may still write into its blocks: freed when it ends
        elif kv_transfer is not None and request.status == RequestStatus.WAITING and kv_transfer.wants_load(request):
            kv_transfer.release_remote(request)  # its read never began: the prefill instance may free now
        elif hand_over and kv_transfer is not None and kv_transfer.should_hold(request, status):
            handed_over = kv_transfer.hold(request, self.kv.block_ids(request.request_id))
        else:
            self.kv.free(request)
        if kv_transfer is not None:
            kv_transfer.forget(request.request_id)
        self.encoder_cache.release_all(request.request_id)
        self._sent.pop(request.request_id, None)
        self._held.discard(request.request_id)
        self._forks.pop(request.request_id, None)  # its forks compute the prompt themselves
        siblings = self._forks.get(request.prefill_from or "")
        if siblings is not None and request in siblings:
            siblings.remove(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        return handed_over
