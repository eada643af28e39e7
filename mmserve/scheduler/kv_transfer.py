"""The scheduler half of prefill/decode disaggregation (vLLM's NixlConnector protocol). Torch-free.

A decode instance's request that comes with `do_remote_prefill` gets blocks for its whole prompt and waits
(`WAITING_FOR_REMOTE_KV`) while the workers read the prefill instance's blocks into them (`KVLoad`). A
prefill instance's request that asked `do_remote_decode` keeps its blocks when it finishes, under a lease,
until a decode instance has read them (the workers report it) or the lease ends. This class keeps those
requests; the scheduler moves them between its queues. It never touches block contents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mmserve.config import KVTransferConfig
from mmserve.request import KVTransferParams, Request, RequestStatus
from mmserve.scheduler.kv_cache_manager import cdiv
from mmserve.scheduler.output import KVLoad

# Finishes whose KV a prefill instance hands over: the prompt is in the KV cache and the engine itself ended
# the request (an abort, an error or a stop string the front end found is never handed over).
_HANDED_OVER = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


@dataclass
class _Lease:
    request: Request
    expires_at: float  # scheduler clock


class KVTransferScheduler:
    def __init__(self, config: KVTransferConfig, engine_id: str, block_size: int, clock: Callable[[], float]) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.clock = clock
        self.loading: dict[str, Request] = {}  # reads in flight, by request id
        self._orphans: dict[str, Request] = {}  # finished while their read was in flight: freed when it ends
        self._new_loads: list[KVLoad] = []  # for the next plan
        self._prefill_here: set[str] = set()  # remote prefill requests whose read failed: computed here
        self._leases: dict[str, _Lease] = {}  # prefill side: finished requests whose blocks wait for a read
        self.num_loads_done = 0
        self.num_loads_failed = 0
        self.num_leases_expired = 0
        self.num_blocks_read = 0
        self.read_s = 0.0

    # -- decode side -----------------------------------------------------------------------------------
    def wants_load(self, request: Request) -> bool:
        """Whether admitting this request means reading its prompt's KV from a prefill instance: it was
        prefilled remotely, no read of it failed, and it was never preempted (the prefill instance frees its
        blocks once read, so a recompute is local)."""
        params = request.sampling_params.kv_transfer
        return (
            params is not None
            and params.do_remote_prefill
            and not request.num_preemptions
            and request.request_id not in self._prefill_here
        )

    def remote_blocks_mismatch(self, request: Request) -> str | None:
        """Why the remote block ids cannot hold this prompt (a different tokenization or block size), or None."""
        params = request.sampling_params.kv_transfer
        assert params is not None and params.remote_block_ids is not None
        needed = cdiv(request.num_prompt_tokens, self.block_size)
        if len(params.remote_block_ids) != needed:
            return (
                f"{len(params.remote_block_ids)} remote blocks for a prompt of {request.num_prompt_tokens} tokens "
                f"in blocks of {self.block_size} (expected {needed})"
            )
        return None

    def start_load(self, request: Request, block_ids: list[int], num_local_blocks: int) -> None:
        """The request holds blocks for its whole prompt, the first `num_local_blocks` from the local prefix
        cache: read the rest from the prefill instance."""
        params = request.sampling_params.kv_transfer
        assert params is not None and params.remote_block_ids is not None
        self.loading[request.request_id] = request
        self._new_loads.append(
            KVLoad(
                request_id=request.request_id,
                remote_engine_id=params.remote_engine_id or "",
                remote_host=params.remote_host or "",
                remote_port=params.remote_port or 0,
                remote_request_id=params.remote_request_id or "",
                remote_tp_size=params.tp_size,
                local_block_ids=tuple(block_ids[num_local_blocks:]),
                remote_block_ids=params.remote_block_ids[num_local_blocks:],
            )
        )

    def release_remote(self, request: Request) -> None:
        """The request ends before its read began: only tell the prefill instance, so it frees its blocks now
        rather than when its lease runs out (vLLM's empty read). Kept as an orphan until that is done."""
        params = request.sampling_params.kv_transfer
        assert params is not None
        self._orphans[request.request_id] = request
        self._new_loads.append(KVLoad(request.request_id, params.remote_engine_id or "", params.remote_host or "",
                                      params.remote_port or 0, params.remote_request_id or "", params.tp_size, (), ()))  # fmt: skip

    def prefill_here(self, request: Request) -> None:
        """The read failed and the policy is `recompute`: from now on this request is prefilled here."""
        self._prefill_here.add(request.request_id)

    def end_load(self, request_id: str) -> tuple[Request | None, bool]:
        """A read ended: (its request, whether it was orphaned meanwhile). (None, False) if unknown."""
        orphan = self._orphans.pop(request_id, None)
        if orphan is not None:
            return orphan, True
        return self.loading.pop(request_id, None), False

    def orphan(self, request: Request) -> bool:
        """The request finished while its read may still write into its blocks: keep them until the read
        ends. False if it is not loading."""
        if self.loading.pop(request.request_id, None) is None:
            return False
        self._orphans[request.request_id] = request
        return True

    def forget(self, request_id: str) -> None:
        self._prefill_here.discard(request_id)

    # -- prefill side ------------------------------------------------------------------------------------
    def should_hold(self, request: Request, status: RequestStatus) -> bool:
        params = request.sampling_params.kv_transfer
        return (
            params is not None
            and params.do_remote_decode
            and self.config.is_producer
            and status in _HANDED_OVER
            and request.num_computed_tokens >= request.num_prompt_tokens
        )

    def hold(self, request: Request, block_ids: list[int]) -> KVTransferParams:
        """Keep a finished request's blocks for a decode instance; what to tell it (vLLM's answer)."""
        self._leases[request.request_id] = _Lease(request, self.clock() + self.config.kv_lease_duration)
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=tuple(block_ids[: cdiv(request.num_prompt_tokens, self.block_size)]),
            remote_host=self.config.side_channel_host,
            remote_port=self.config.side_channel_port,
            remote_request_id=request.request_id,
            tp_size=1,
        )

    def release(self, request_id: str) -> Request | None:
        """A decode instance has read the request's blocks: its lease ends (None if it had expired)."""
        lease = self._leases.pop(request_id, None)
        return lease.request if lease is not None else None

    def expired(self) -> list[Request]:
        """The leases that ran out (no decode instance read their blocks in time); they end now."""
        now = self.clock()
        gone = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        self.num_leases_expired += len(gone)
        return [self._leases.pop(rid).request for rid in gone]

    # -- both --------------------------------------------------------------------------------------------
    def take_new_loads(self) -> tuple[KVLoad, ...]:
        loads, self._new_loads = tuple(self._new_loads), []
        return loads

    def has_pending(self) -> bool:
        """Reads in flight or leases open: the workers must keep reporting, also while nothing runs."""
        return bool(self.loading or self._orphans or self._leases)

    @property
    def num_leases(self) -> int:
        return len(self._leases)
