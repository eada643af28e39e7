"""What the router tests add to `mmserve bench router`'s replicas and KV event log: a replica that can crash
and come back on its ports, and a log that also tracks the blocks each replica holds, read as snapshots."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from mmserve.bench import router as bench


class Replica(bench.Replica):
    """The bench's replica; `kill` is a crash (SIGKILL: no drain), `start` brings it back on the same ports."""

    @property
    def pid(self) -> int:
        assert self.server is not None and self.server.proc is not None
        return self.server.proc.pid

    def kill(self) -> None:
        """SIGKILL the server: its engine core and decode workers exit on their parent's death."""
        assert self.server is not None and self.server.proc is not None
        self.server.proc.kill()
        self.server.proc.wait()
        self.close()  # server None: not running, as after `close`


@dataclass
class ReplicaEvents(bench.ReplicaEvents):
    held: set[bytes] = field(default_factory=set)  # hashes announced and not removed
    stored_hashes: list[bytes] = field(default_factory=list)  # in announcement order
    num_batches: int = 0
    last_seq: int | None = None  # the last batch's number


class KVEventLog(bench.KVEventLog):
    """The bench's log (stored blocks, verified hash chains, snapshots counted), also tracking held blocks and
    batch numbers; `snapshot` copies one replica's record as of now."""

    record_type = ReplicaEvents
    by_url: dict[str, ReplicaEvents]

    def _apply(self, url: str, seq: int, events: list[dict]) -> None:
        log = self.by_url[url]
        log.num_batches += 1
        log.last_seq = seq
        for event in events:
            if event["type"] == "BlockStored":
                log.stored_hashes += event["block_hashes"]
                log.held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                log.held.difference_update(event["block_hashes"])
            elif event["type"] == "AllBlocksCleared":
                log.held.clear()
        super()._apply(url, seq, events)

    def snapshot(self, url: str) -> ReplicaEvents:
        self.update()
        return copy.deepcopy(self.by_url[url])
