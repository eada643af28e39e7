"""`mmserve bench router`: mmserve replicas behind vllm-router (PyPI), routing policies side by side on a
prefix-heavy multimodal workload — families of requests that share an image and a system prompt.

Per policy: the replicas' prefix-cache hit rate (summed from their /metrics), output tok/s and TTFT as the
client saw them through the router, and how well each family stuck to one replica. Which replica served a
request is read off the replicas' own KV events: the request's last full prompt block (its own text, no other
request has it) is announced by the replica that computed it.

Also the harness the router tests use: `Replica` (`mmserve serve` with KV events, killable and restartable on
the same ports), `RouterProcess` (vllm-router over given replicas) and `KVEventLog` (a ZeroMQ subscriber).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from mmserve.bench import RouterBenchConfig
from mmserve.bench.load import cache_figures, scrape_cache_counters, send_http
from mmserve.bench.metrics import RequestTiming, compute_metrics
from mmserve.bench.servers import ServerProcess, wait_until_healthy
from mmserve.bench.workload import Request, image_data_url, image_part, load_tokenizer, random_text, text_part

SERVED_MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_router_binary() -> str:
    """The `vllm-router` executable beside this Python (its venv), else on PATH."""
    candidate = Path(sys.executable).parent / "vllm-router"
    found = str(candidate) if candidate.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router")
    return found


# -- replicas -----------------------------------------------------------------------------------------------


class Replica:
    """One `mmserve serve` replica on fixed ports (HTTP, KV events, their replay), publishing KV events and
    vLLM's gauge names. `kill` is a crash (SIGKILL: no drain); `start` again brings it back on the same ports."""

    def __init__(self, model: Path, num_kv_blocks: int = 256, block_size: int = 16, extra_args: tuple[str, ...] = ()):
        self.model, self.num_kv_blocks, self.block_size, self.extra_args = model, num_kv_blocks, block_size, extra_args
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_endpoint = f"tcp://127.0.0.1:{self.events_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self.server: ServerProcess | None = None

    def start(self, wait: bool = True) -> Replica:
        events = msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": self.events_endpoint,
                                      "replay_endpoint": self.replay_endpoint}).decode()  # fmt: skip
        self.server = ServerProcess(
            self.model,
            port=self.port,
            served_model_name=SERVED_MODEL_NAME,
            wait=wait,
            extra_args=("--kv-events-config", events, "--vllm-metric-names", "--decode-workers", "1",
                        "--num-kv-blocks", str(self.num_kv_blocks), "--block-size", str(self.block_size),
                        *self.extra_args),
        )
        return self

    def wait_until_up(self) -> None:
        assert self.server is not None
        self.server.wait_until_up()

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server is not None and self.server.proc is not None else None

    def kill(self) -> None:
        """SIGKILL the server: its engine core and decode workers exit on their parent's death."""
        if self.server is not None and self.server.proc is not None:
            self.server.proc.kill()
            self.server.proc.wait()
            self.server.close()
            self.server = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def start_replicas(model: Path, n: int, **kwargs: Any) -> list[Replica]:
    """`n` replicas started together (their start-ups overlap); all closed again if one fails."""
    replicas = [Replica(model, **kwargs) for _ in range(n)]
    try:
        for replica in replicas:
            replica.start(wait=False)
        for replica in replicas:
            replica.wait_until_up()
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    return replicas


# -- the router ---------------------------------------------------------------------------------------------


class RouterProcess:
    """vllm-router over `replicas` with `policy`, on loopback, health-checking every second (so a dead replica
    leaves the rotation quickly and a restarted one rejoins). `kv_aware` subscribes to the replicas' KV events."""

    def __init__(
        self,
        policy: str,
        replicas: list[Replica],
        model: Path,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [vllm_router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
               "--worker-urls", *(r.url for r in replicas),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--log-level", "warning"]  # fmt: skip
        if policy == "kv_aware":
            # The model's identity for the router: the name the replicas serve it under.
            cmd += ["--kv-event-model", SERVED_MODEL_NAME, "--kv-event-block-size", str(replicas[0].block_size)]
            for r in replicas:
                cmd += ["--kv-event-source", f"{r.url}={r.events_endpoint}"]
                cmd += ["--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
        cmd += list(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="mmserve-router-")
        self.log_path = Path(self._tmp.name) / "router.log"
        self._log = self.log_path.open("w")
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
            # /health is 200 once every worker is healthy (503 naming the others before)
            wait_until_healthy(self.proc, self.url, startup_timeout_s, self.log_path, "vllm-router")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()


# -- KV events, as a router sees them ------------------------------------------------------------------------


@dataclass
class _ReplicaEvents:
    held: set[bytes] = field(default_factory=set)  # hashes announced and not removed
    stored_blocks: set[tuple[int, ...]] = field(default_factory=set)  # token ids of every block ever stored
    stored_hashes: list[bytes] = field(default_factory=list)  # in announcement order
    chains_ok: bool = True  # every BlockStored's hashes follow from its tokens, media keys and parent
    num_decode_errors: int = 0  # batches that were not vLLM's format
    num_cleared: int = 0  # AllBlocksCleared events: a reset, or a snapshot sent because someone subscribed
    num_batches: int = 0
    last_seq: int | None = None


class KVEventLog:
    """Subscribes to each replica's KV event endpoint on a thread (ZeroMQ SUB) and applies the batches."""

    def __init__(self, replicas: list[Replica]) -> None:
        import zmq

        from mmserve.scheduler.kv_cache_manager import hash_block

        self._hash_block = hash_block
        self._context = zmq.Context()
        self._sockets = {}
        self.by_url: dict[str, _ReplicaEvents] = {}
        for r in replicas:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(r.events_endpoint)
            self._sockets[r.url] = sub
            self.by_url[r.url] = _ReplicaEvents()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for sub in self._sockets.values():
            poller.register(sub, zmq.POLLIN)
        url_of = {sub: url for url, sub in self._sockets.items()}
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                frames = sub.recv_multipart()
                try:
                    _, seq, payload = frames
                    self._apply(url_of[sub], int.from_bytes(seq, "big"), payload)
                except (ValueError, KeyError, TypeError, IndexError, msgspec.DecodeError):
                    with self._lock:
                        self.by_url[url_of[sub]].num_decode_errors += 1

    def _apply(self, url: str, seq: int, payload: bytes) -> None:
        _, events, *_ = msgspec.msgpack.decode(payload)  # untyped: the wire as any subscriber reads it
        with self._lock:
            log = self.by_url[url]
            log.num_batches += 1
            log.last_seq = seq
            for event in events:
                kind = event["type"]
                if kind == "BlockStored":
                    bs, parent = event["block_size"], event["parent_block_hash"] or b""
                    keys = event["extra_keys"] or [None] * len(event["block_hashes"])
                    for i, block_hash in enumerate(event["block_hashes"]):
                        tokens = event["token_ids"][i * bs : (i + 1) * bs]
                        log.chains_ok &= self._hash_block(parent, tokens, tuple(keys[i] or ())) == block_hash
                        log.stored_blocks.add(tuple(tokens))
                        log.stored_hashes.append(block_hash)
                        log.held.add(block_hash)
                        parent = block_hash
                elif kind == "BlockRemoved":
                    log.held.difference_update(event["block_hashes"])
                elif kind == "AllBlocksCleared":
                    log.held.clear()
                    log.num_cleared += 1

    def snapshot(self, url: str) -> _ReplicaEvents:
        with self._lock:
            log = self.by_url[url]
            return _ReplicaEvents(set(log.held), set(log.stored_blocks), list(log.stored_hashes), log.chains_ok,
                                  log.num_decode_errors, log.num_cleared, log.num_batches, log.last_seq)  # fmt: skip

    def wait_until_subscribed(self, timeout_s: float = 60.0) -> None:
        """Until every replica has answered this subscription with its cache snapshot (AllBlocksCleared, then
        what it holds), so the log starts from the replicas' real state."""
        self.wait_for_snapshots({url: 0 for url in self.by_url}, timeout_s)

    def wait_for_snapshots(self, cleared_before: dict[str, int], timeout_s: float = 30.0) -> None:
        """Until each replica in `cleared_before` has sent another AllBlocksCleared than it had then: the
        snapshot a new subscriber (a router starting) triggers reaches every subscriber, this log included."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                waiting = [url for url, n in cleared_before.items() if self.by_url[url].num_cleared <= n]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no KV cache snapshot from {waiting}")
            time.sleep(0.05)

    def num_cleared(self) -> dict[str, int]:
        with self._lock:
            return {url: log.num_cleared for url, log in self.by_url.items()}

    def wait_for_blocks(self, blocks: list[tuple[int, ...]], timeout_s: float = 30.0) -> list[list[str]]:
        """For each block's tokens, the replicas that stored it, once every block is announced somewhere (or
        `timeout_s` passed: blocks still unannounced then get [])."""
        deadline = time.monotonic() + timeout_s
        while True:
            served = [self.served_by(block) for block in blocks]
            if all(served) or time.monotonic() > deadline:
                return served
            time.sleep(0.1)

    def served_by(self, block_tokens: tuple[int, ...]) -> list[str]:
        """The replicas that stored a block with exactly these tokens."""
        with self._lock:
            return [url for url, log in self.by_url.items() if block_tokens in log.stored_blocks]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sub in self._sockets.values():
            sub.close(linger=0)
        self._context.term()


# -- the workload -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyRequest:
    family: int
    request: Request


def family_requests(cfg: RouterBenchConfig, media: str, seed: int, tokenizer: Any | None) -> list[FamilyRequest]:
    """Each family: one system prompt of about `system_len` tokens and (`media` "image") one image; each
    request of it adds a user text of its own (about `user_len` tokens, a numbered opening so no two are
    alike) after the image. Families interleave in random order, as independent users' conversations would."""
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    out: list[FamilyRequest] = []
    for f in range(cfg.num_families):
        image = image_data_url(np_rng, cfg.image_size) if media == "image" else None
        system = random_text(rng, cfg.system_len, tokenizer)
        for i in range(cfg.requests_per_family):
            user: Any = f"Request {seed}-{f}-{i}: " + random_text(rng, cfg.user_len, tokenizer)
            user = [image_part(image), text_part(user)] if image is not None else user
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            out.append(FamilyRequest(f, Request(messages, cfg.output_len)))
    rng.shuffle(out)
    return out


async def _prompt_tokens(client: Any, url: str, req: Request) -> list[int]:
    r = await client.post(f"{url}/tokenize", json={"model": SERVED_MODEL_NAME, "messages": req.messages})
    r.raise_for_status()
    return r.json()["tokens"]


def last_full_block(tokens: list[int], block_size: int) -> tuple[int, ...]:
    """The last block of the prompt that the KV cache registers (full, and not the block of its last token):
    the request's own text, when that text is longer than two blocks (so it identifies the request)."""
    k = (len(tokens) - 1) // block_size - 1
    if k < 0:
        raise ValueError("a prompt needs at least two blocks to be attributed to a replica")
    return tuple(tokens[k * block_size : (k + 1) * block_size])


async def run_policy(
    policy: str,
    replicas: list[Replica],
    model: Path,
    requests: list[FamilyRequest],
    concurrency: int,
) -> dict:
    """One policy's run: a router over the replicas, the requests at `concurrency` in flight, then the figures."""
    import httpx

    log = KVEventLog(replicas)
    router: RouterProcess | None = None
    try:
        log.wait_until_subscribed()
        cleared = log.num_cleared()
        router = RouterProcess(policy, replicas, model)
        if policy == "kv_aware":
            log.wait_for_snapshots(cleared)  # the router starts from what the replicas hold
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            blocks = [last_full_block(await _prompt_tokens(client, replicas[0].url, fr.request), replicas[0].block_size)
                      for fr in requests]  # fmt: skip
            before = await scrape_cache_counters(client, [r.url for r in replicas])
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(requests)):
                queue.put_nowait(i)
            timings: list[RequestTiming | None] = [None] * len(requests)

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    timings[i] = await send_http(client, router.url, requests[i].request, {})

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            duration = time.perf_counter() - start
            after = await scrape_cache_counters(client, [r.url for r in replicas])
        served = log.wait_for_blocks(blocks)
        chains_ok = all(log.snapshot(r.url).chains_ok for r in replicas)
    finally:
        if router is not None:
            router.close()
        log.close()
    done = [t for t in timings if t is not None]
    figures = {"policy": policy, **compute_metrics(done, duration), **cache_figures(before, after)}
    figures["requests_per_replica"] = dict(Counter(s[0] if len(s) == 1 else "unknown" for s in served))
    figures["family_stickiness"] = family_stickiness([fr.family for fr in requests], served)
    figures["kv_event_chains_ok"] = chains_ok
    return figures


def family_stickiness(families: list[int], served: list[list[str]]) -> float:
    """Over families, the share of a family's requests served by the replica that served most of them
    (1.0: every family on one replica; about 1/replicas for a router blind to content)."""
    by_family: dict[int, Counter[str]] = {}
    for family, replicas in zip(families, served, strict=True):
        by_family.setdefault(family, Counter())[replicas[0] if len(replicas) == 1 else "unknown"] += 1
    shares = [max(c.values()) / sum(c.values()) for c in by_family.values()]
    return float(np.mean(shares))


def bench_router(model: Path, cfg: RouterBenchConfig) -> dict:
    """Every (media, policy) over the same replicas. Each run gets a workload of its own draw (other images and
    prompts, the same shape), so none finds another's families in the caches."""
    from dataclasses import asdict

    tokenizer = load_tokenizer(model)
    replicas = start_replicas(model, cfg.num_replicas, num_kv_blocks=cfg.num_kv_blocks)
    results: dict[str, dict[str, dict]] = {}
    try:
        run = 0
        for media in cfg.media:
            for policy in cfg.policies:
                run += 1
                requests = family_requests(cfg, media, cfg.seed * 1000 + run, tokenizer)
                figures = asyncio.run(run_policy(policy, replicas, model, requests, cfg.concurrency))
                results.setdefault(media, {})[policy] = figures
    finally:
        for replica in replicas:
            replica.close()
    report: dict = {"config": {"model": str(model), **asdict(cfg)}, "results": results, "vs_round_robin": {}}
    for media, by_policy in results.items():
        base = by_policy.get("round_robin")
        if base is None:
            continue
        report["vs_round_robin"][media] = {
            policy: {
                "output_throughput": r["output_throughput"] / base["output_throughput"],
                "prefix_cache_hit_rate": _ratio(r["server_prefix_cache_hit_rate"], base["server_prefix_cache_hit_rate"]),
                "ttft_median": _ratio(r["median_ttft_ms"], base["median_ttft_ms"]),
            }
            for policy, r in by_policy.items()
        }  # fmt: skip
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_report(report: dict) -> str:
    lines = ["media  policy        tok/s   prefix hit  mm hit   TTFT p50 ms  p90 ms  stickiness  failed"]
    for media, by_policy in report["results"].items():
        for policy, r in by_policy.items():
            lines.append(
                f"{media:<6} {policy:<12} {r['output_throughput']:7.1f}   {_pct(r['server_prefix_cache_hit_rate'])}"
                f"     {_pct(r['server_mm_cache_hit_rate'])}  {r['median_ttft_ms']:9.1f}  {r['p90_ttft_ms']:7.1f}"
                f"  {r['family_stickiness']:9.2f}  {r['failed']:6d}"
            )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "   n/a" if value is None else f"{100 * value:5.1f}%"
