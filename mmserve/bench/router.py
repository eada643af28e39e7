"""`mmserve bench router`: mmserve replicas behind vllm-router (PyPI), its routing policies side by side on
families of requests that share a system prompt (and an image): the replicas' cache hit rates, tok/s and TTFT
through the router, and how well each family stuck to one replica, as the replicas' own KV events tell."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np
import zmq

from mmserve.bench import RouterBenchConfig, num, table
from mmserve.bench.load import run_requests
from mmserve.bench.metrics import compute_metrics, ratio
from mmserve.bench.servers import ServerProcess, free_port, wait_until_healthy
from mmserve.bench.workload import Request, load_tokenizer, media_parts, random_text, user
from mmserve.scheduler.kv_cache_manager import hash_block

SERVED_MODEL_NAME = "bench"  # the replicas' model name: what clients send and the router's KV events model


class Replica:
    """One `mmserve serve` publishing KV events and vLLM's metric names, on ports fixed at construction (HTTP,
    KV events, their replay): started again, it is the same replica to the router."""

    def __init__(self, model: Path, num_kv_blocks: int = 256, block_size: int = 16) -> None:
        self.model, self.block_size, self.port = model, block_size, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_endpoint, self.replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        events = msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": self.events_endpoint,
                                      "replay_endpoint": self.replay_endpoint}).decode()  # fmt: skip
        self.args = ("--kv-events-config", events, "--vllm-metric-names", "--decode-workers", "1",
                     "--num-kv-blocks", str(num_kv_blocks), "--block-size", str(block_size))  # fmt: skip
        self.server: ServerProcess | None = None  # None: not started, or closed

    def start(self, wait: bool = True) -> ServerProcess:
        self.server = ServerProcess(self.model, port=self.port, served_model_name=SERVED_MODEL_NAME,
                                    extra_args=self.args, wait=wait)  # fmt: skip
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


R = TypeVar("R", bound=Replica)


@contextlib.contextmanager
def running(replicas: list[R]) -> Iterator[list[R]]:
    """`replicas` started together (start-ups overlap); all closed on leaving, or when one fails to start."""
    try:
        for server in [r.start(wait=False) for r in replicas]:
            server.wait_until_up()
        yield replicas
    finally:
        for r in replicas:
            r.close()


class RouterProcess:
    """vllm-router over `replicas` with `policy`, on loopback, health-checking every second (a dead replica
    leaves the rotation quickly, a restarted one rejoins); `kv_aware` subscribes to their KV events."""

    def __init__(self, policy: str, replicas: list[Replica], extra_args: tuple[str, ...] = ()) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # `vllm-router`, as this Python runs it (pip install vllm-router: Rust, driven from Python)
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--policy", policy, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", "--worker-urls", *(r.url for r in replicas),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1"]  # fmt: skip
        if policy == "kv_aware":
            cmd += ["--kv-event-model", SERVED_MODEL_NAME, "--kv-event-block-size", str(replicas[0].block_size)]
            for r in replicas:
                cmd += ["--kv-event-source", f"{r.url}={r.events_endpoint}",
                        "--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]  # fmt: skip
        self._log = tempfile.NamedTemporaryFile("w", prefix="mmserve-router-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([*cmd, *extra_args], stdout=self._log, stderr=subprocess.STDOUT)
        try:  # /health is 200 once every worker is healthy (503 naming the others before)
            wait_until_healthy(self.proc, self.url, 60.0, Path(self._log.name), "vllm-router")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.kill()  # no graceful stop needed: it keeps nothing and starts no children
        self.proc.wait()
        self._log.close()


def kv_transfer_config(role: str, side_channel_port: int, policy: str = "fail", **extra: Any) -> str:
    """--kv-transfer-config's JSON for an instance of `role` (kv_producer | kv_consumer | kv_both) whose NIXL side
    channel listens on loopback at `side_channel_port`; `extra`: more of kv_connector_extra_config."""
    return json.dumps({
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": side_channel_port, **extra},
    })  # fmt: skip


def pd_instance(model: Path, role: str, extra_args: tuple[str, ...] = (), wait: bool = True,
                env: dict[str, str] | None = None, **extra: Any) -> ServerProcess:  # fmt: skip
    """`mmserve serve` as a prefill or decode instance on free ports (HTTP and side channel). `env`: set in the
    server's environment (e.g. UCX_TLS); `extra`: kv_connector_extra_config fields (policy= the failure policy)."""
    args = ("--kv-transfer-config", kv_transfer_config(role, free_port(), **extra), *extra_args)
    return ServerProcess(model, served_model_name=SERVED_MODEL_NAME, extra_args=args, wait=wait, env=env)


class PDRouterProcess:
    """vllm-router in vLLM's prefill/decode mode (`--vllm-pd-disaggregation --kv-connector nixl`) over prefill and
    decode instances started with --kv-transfer-config, on loopback, round robin within each role."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1"]  # fmt: skip
        for url in prefill_urls:
            cmd += ["--prefill", url]
        for url in decode_urls:
            cmd += ["--decode", url]
        self._log = tempfile.NamedTemporaryFile("w", prefix="mmserve-pd-router-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(self.proc, self.url, 60.0, Path(self._log.name), "vllm-router")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


@dataclass
class ReplicaEvents:
    """What one replica's KV events have announced."""

    stored_blocks: set[tuple[int, ...]] = field(default_factory=set)  # token ids of every block ever stored
    chains_ok: bool = True  # every BlockStored's hashes follow from its tokens, media keys and parent
    num_decode_errors: int = 0  # batches that were not vLLM's format (their blocks are unverified)
    num_cleared: int = 0  # AllBlocksCleared: a reset, or the cache snapshot sent when someone subscribes


class KVEventLog:
    """Subscribes to every replica's KV events (ZeroMQ SUB, vLLM's format). ZeroMQ queues what arrives (no
    limit); each read of the log first applies what has arrived."""

    record_type: type[ReplicaEvents] = ReplicaEvents  # what is kept per replica (a subclass may keep more)

    def __init__(self, replicas: list[Replica]) -> None:
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}  # url -> its SUB socket
        for r in replicas:
            sub = self._sockets[r.url] = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 0)  # no limit: no batch is dropped between reads
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(r.events_endpoint)
        self.by_url = {r.url: self.record_type() for r in replicas}

    def update(self) -> None:
        """Applies every batch that has arrived, in each replica's order."""
        for url, sub in self._sockets.items():
            while sub.poll(0):
                try:  # frames: [topic, seq (8 bytes big-endian), msgpack [ts, [event, ...], ...]]
                    _, seq, payload = sub.recv_multipart()
                    _, events, *_ = msgspec.msgpack.decode(payload)  # untyped, as any subscriber reads it
                    self._apply(url, int.from_bytes(seq, "big"), events)
                except (ValueError, KeyError, TypeError, IndexError, msgspec.DecodeError):
                    self.by_url[url].num_decode_errors += 1

    def _apply(self, url: str, seq: int, events: list[dict]) -> None:
        """One batch (number `seq`: a gap means batches were dropped) of replica `url`."""
        log = self.by_url[url]
        for event in events:
            if event["type"] == "BlockStored":
                bs, parent = event["block_size"], event["parent_block_hash"] or b""
                keys = event["extra_keys"] or [None] * len(event["block_hashes"])
                for i, block_hash in enumerate(event["block_hashes"]):
                    tokens = event["token_ids"][i * bs : (i + 1) * bs]
                    log.chains_ok &= hash_block(parent, tokens, tuple(keys[i] or ())) == block_hash
                    log.stored_blocks.add(tuple(tokens))
                    parent = block_hash
            elif event["type"] == "AllBlocksCleared":
                log.num_cleared += 1

    def num_cleared(self) -> dict[str, int]:
        self.update()
        return {url: log.num_cleared for url, log in self.by_url.items()}

    def wait_for_snapshots(self, cleared_before: dict[str, int] | None = None, timeout_s: float = 60) -> None:
        """Until each replica sent more AllBlocksCleared than `cleared_before` (None: none). Every subscriber
        gets a new one's snapshot: so this log (None), or a router started since the counts, is subscribed."""
        before, deadline = cleared_before or dict.fromkeys(self.by_url, 0), time.monotonic() + timeout_s
        while waiting := [url for url, now in self.num_cleared().items() if url in before and now <= before[url]]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no KV cache snapshot from {waiting}")
            time.sleep(0.05)

    def wait_for_blocks(self, blocks: list[tuple[int, ...]], timeout_s: float = 30.0) -> list[list[str]]:
        """For each block's tokens, the replicas that stored it, once every block is announced somewhere (or
        `timeout_s` passed: blocks still unannounced then get [])."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.update()
            served = [[url for url, log in self.by_url.items() if b in log.stored_blocks] for b in blocks]
            if all(served) or time.monotonic() > deadline:
                return served
            time.sleep(0.05)

    def close(self) -> None:
        self._context.destroy(linger=0)  # its sockets too


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
        image = media_parts(np_rng, int(media == "image"), cfg.image_size)  # one image part, or none
        system = {"role": "system", "content": random_text(rng, cfg.system_len, tokenizer)}
        for i in range(cfg.requests_per_family):
            text = f"Request {seed}-{f}-{i}: " + random_text(rng, cfg.user_len, tokenizer)
            out.append(FamilyRequest(f, Request([system, *user(text, image)], cfg.output_len)))
    rng.shuffle(out)
    return out


def last_full_block(tokens: list[int], block_size: int) -> tuple[int, ...]:
    """The last block of the prompt that the KV cache registers (full, and not the block of its last token):
    the request's own text, when that text is longer than two blocks (so it identifies the request)."""
    k = (len(tokens) - 1) // block_size - 1
    if k < 0:
        raise ValueError("a prompt needs at least two blocks to be attributed to a replica")
    return tuple(tokens[k * block_size : (k + 1) * block_size])


def family_stickiness(families: list[int], served: list[list[str]]) -> float:
    """Over families, the share of a family's requests served by the replica that served most of them
    (1.0: every family on one replica; about 1/replicas for a router blind to content)."""
    by_family: dict[int, Counter[str]] = {}
    for family, replicas in zip(families, served, strict=True):
        by_family.setdefault(family, Counter())[replicas[0] if len(replicas) == 1 else "unknown"] += 1
    return float(np.mean([max(c.values()) / sum(c.values()) for c in by_family.values()]))


def prompt_block(replica: Replica, req: Request) -> tuple[int, ...]:
    """`req`'s last full prompt block, as `replica` tokenizes it (every replica does alike)."""
    body = {"model": SERVED_MODEL_NAME, "messages": req.messages}
    r = httpx.post(replica.url + "/tokenize", json=body, timeout=300).raise_for_status()
    return last_full_block(r.json()["tokens"], replica.block_size)


def run_policy(policy: str, replicas: list[Replica], requests: list[FamilyRequest], concurrency: int) -> dict:
    """One policy's run: a router over the replicas, the requests at `concurrency` in flight (closed loop),
    the figures. A request was served by the replica whose KV events announced its last full prompt block."""
    with contextlib.closing(KVEventLog(replicas)) as log:
        log.wait_for_snapshots()  # subscribed: none of this run's events is missed
        cleared = log.num_cleared()
        with contextlib.closing(RouterProcess(policy, replicas)) as router:
            if policy == "kv_aware":
                log.wait_for_snapshots(cleared)  # the router subscribed: it knows what the replicas hold
            blocks = [prompt_block(replicas[0], fr.request) for fr in requests]
            # no warm-up request: the router would place it (and its prefix) too
            timings, duration, caches = asyncio.run(run_requests(
                router.url, [fr.request for fr in requests], "http", max_concurrency=concurrency,
                metrics_urls=[r.url for r in replicas], model=SERVED_MODEL_NAME,
                warm_up=False, progress=False))  # fmt: skip
        served = log.wait_for_blocks(blocks)  # per request, the replicas that announced its block
        chains_ok = all(r.chains_ok and not r.num_decode_errors for r in log.by_url.values())
        return {"policy": policy, **compute_metrics(timings, duration), **caches,
                "requests_per_replica": dict(Counter(s[0] if len(s) == 1 else "unknown" for s in served)),
                "family_stickiness": family_stickiness([fr.family for fr in requests], served),
                "kv_event_chains_ok": chains_ok}  # fmt: skip


def bench_router(model: Path, cfg: RouterBenchConfig) -> dict:
    """Every (media, policy) over the same replicas. Each run gets a workload of its own draw (other images
    and prompts, the same shape), so none finds another's families in the caches."""
    tokenizer = load_tokenizer(model)
    results: dict[str, dict[str, dict]] = {}
    with running([Replica(model, cfg.num_kv_blocks) for _ in range(cfg.num_replicas)]) as replicas:
        runs = [(media, policy) for media in cfg.media for policy in cfg.policies]
        for run, (media, policy) in enumerate(runs, start=1):
            requests = family_requests(cfg, media, cfg.seed * 1000 + run, tokenizer)
            results.setdefault(media, {})[policy] = run_policy(policy, replicas, requests, cfg.concurrency)
    ratios = {"output_throughput": "output_throughput",  # each ratio's name -> its figure
              "prefix_cache_hit_rate": "server_prefix_cache_hit_rate", "ttft_median": "median_ttft_ms"}  # fmt: skip
    vs_round_robin = {media: {policy: {name: ratio(r[key], base[key]) for name, key in ratios.items()}
                              for policy, r in by_policy.items()}
                      for media, by_policy in results.items() if (base := by_policy.get("round_robin"))}  # fmt: skip
    return {"config": {"model": str(model), **asdict(cfg)}, "results": results, "vs_round_robin": vs_round_robin}


def format_report(report: dict) -> str:
    rows = [(media, policy, num(r["output_throughput"]), num(r["server_prefix_cache_hit_rate"], ".1%"),
             num(r["server_mm_cache_hit_rate"], ".1%"), num(r["median_ttft_ms"]), num(r["p90_ttft_ms"]),
             num(r["family_stickiness"], ".2f"), r["failed"])
            for media, by_policy in report["results"].items() for policy, r in by_policy.items()]  # fmt: skip
    return table(("media", "policy", "tok/s", "prefix hit", "mm hit", "TTFT p50 ms", "p90 ms", "stickiness",
                  "failed"), rows)  # fmt: skip
