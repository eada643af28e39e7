"""The tensor-parallel group one model shard runs in: its rank, and the collectives the sharded layers
call (all-reduce, all-gather, gather to the first rank) over torch.distributed process groups that
belong to this object alone (no global default group: two engines in one process do not collide).

NCCL carries device tensors on CUDA and gloo everything on the CPU; a gloo group always exists for
host-side control. A group of one rank communicates nothing. Knows nothing of models or requests.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

_STORE_TIMEOUT_S = 120.0  # every rank must reach the rendezvous within this (weights load after it)


@dataclass
class CommStats:
    """Bytes each collective kind moved from this rank (its input tensors), since the last reset."""

    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    gather_bytes: int = 0


class TensorParallelGroup:
    def __init__(
        self,
        rank: int,
        world_size: int,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        if world_size > 1 and (device_group is None or cpu_group is None):
            raise ValueError("a group of several ranks needs its process groups")
        self.rank, self.world_size = rank, world_size
        self._device_group, self._cpu_group = device_group, cpu_group
        self._store = store  # kept alive: the process groups rendezvous through it
        self.stats = CommStats()

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1)

    @staticmethod
    def rendezvous(
        host: str, port: int, world_size: int, is_first: bool, listen_fd: int | None = None
    ) -> dist.TCPStore:
        """The key-value store the ranks meet through: hosted by the first rank (`port` 0: any free
        port, read back from `store.port`; `listen_fd`: a socket it already listens on), joined by the
        others (who wait for it up to the store's timeout)."""
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=is_first,
            timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
    ) -> TensorParallelGroup:
        """Join the group (blocks until every rank has). Every collective then fails, instead of
        waiting forever, once a peer is silent for `timeout_s`; a peer that exits makes the next
        collective fail at once."""
        if world_size == 1:
            return cls.single()
        timeout = datetime.timedelta(seconds=timeout_s)
        cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("tp-cpu/", store), rank, world_size, timeout)
        device_group: dist.ProcessGroup = cpu_group
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl/", store), rank, world_size, options)
        return cls(rank, world_size, device_group, cpu_group, store)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _group(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        group = self._cpu_group if tensor.device.type == "cpu" else self._device_group
        assert group is not None  # world_size > 1 here
        return group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        if self.world_size == 1:
            return tensor
        if not tensor.is_contiguous():
            contiguous = tensor.contiguous()
            self.all_reduce(contiguous)
            return tensor.copy_(contiguous)
        self.stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        self._group(tensor).allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all ranks), in rank order."""
        if self.world_size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.stats.all_gather_bytes += tensor.numel() * tensor.element_size()
        self._group(tensor).allgather([out], [tensor]).wait()
        return out

    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `tensor` (same shape on all ranks) concatenated along `dim` on the first rank;
        None on the others."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        self.stats.gather_bytes += tensor.numel() * tensor.element_size()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.is_first:
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._group(tensor).gather([out], [tensor], options).wait()
            return torch.cat(out, dim=dim)
        self._group(tensor).gather([], [tensor], options).wait()
        return None

    def take_stats(self) -> CommStats:
        stats, self.stats = self.stats, CommStats()
        return stats

    def abort_device_group(self) -> None:
        """From another thread, when a rank is gone: NCCL collectives waiting on it fail now. (gloo
        fails by itself when a peer's connection closes; its group is left alone.)"""
        group = self._device_group
        if group is not None and group is not self._cpu_group:
            with contextlib.suppress(Exception):
                group.abort()

    def close(self, abort: bool = False) -> None:
        """Release the process groups: after the last collective of every rank, or (`abort`, a rank
        is gone) without waiting for work in flight."""
        for group in {id(g): g for g in (self._device_group, self._cpu_group) if g is not None}.values():
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to release cleanly
                group.abort() if abort else group.shutdown()
        self._device_group = self._cpu_group = None
        self._store = None
