"""`mmserve bench`: speed measured side by side in one run, written as JSON.

What the CLI needs cheaply lives here (no numpy, no torch): the systems and workloads it lists, and the
frozen configs its options are generated from."""

from __future__ import annotations

from dataclasses import dataclass

# Systems `mmserve bench throughput` compares (torch-free here so the CLI can list them cheaply).
SYSTEMS = ("mmserve", "mmserve-no-chunk", "mmserve-static", "mmserve-structured", "hf-static", "hf-cb")
WORKLOADS = ("random", "random-mm", "prefix", "long-video")
ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")  # vllm-router's, as `bench router` compares them


@dataclass(frozen=True)
class RouterBenchConfig:
    """`mmserve bench router`: each field is one command-line option (`--num-families`...) and a key of the
    report's `config`."""

    policies: tuple[str, ...] = ROUTER_POLICIES  # vllm-router policies, side by side over the same replicas
    media: tuple[str, ...] = ("image", "none")  # image: a family shares an image and a system prompt; none: the prompt
    num_replicas: int = 2
    num_families: int = 4
    requests_per_family: int = 12
    concurrency: int = 4  # requests in flight through the router (closed loop)
    system_len: int = 96  # tokens of each family's system prompt (about)
    user_len: int = 48  # tokens of each request's own text (about)
    output_len: int = 16
    image_size: int = 64
    num_kv_blocks: int = 1024  # per replica: enough that nothing is evicted in a run
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in ROUTER_POLICIES] + [m for m in self.media if m not in ("image", "none")]
        if unknown:
            raise ValueError(f"unknown policy or media: {', '.join(unknown)}")
        if min(self.num_replicas, self.num_families, self.requests_per_family, self.concurrency) < 1:
            raise ValueError("num_replicas, num_families, requests_per_family and concurrency must be >= 1")


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # as config.KV_CACHE_DTYPE_NAMES ("fp8" is fp8_e4m3)


@dataclass(frozen=True)
class KVCacheBenchConfig:
    """`mmserve bench kv-cache`: each field is one command-line option and a key of the report's `config`."""

    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES  # side by side; the first is the accuracy reference
    dtype: str = "float32"  # the compute dtype of every engine
    kv_cache_tokens: int = 2048  # the pool's memory: this many tokens in the compute dtype
    num_requests: int = 48  # the capacity batch, all submitted at once
    prompt_len: int = 96  # tokens (about)
    output_len: int = 64  # forced (ignore_eos)
    accuracy_prompts: int = 24
    accuracy_tokens: int = 24  # greedy tokens compared per prompt
    calculate_kv_scales: bool = False
    repeats: int = 2  # timed batches per dtype, interleaved across dtypes; the median counts
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [d for d in self.kv_cache_dtypes if d not in KV_CACHE_DTYPES]
        if unknown or not self.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtypes: choose from {', '.join(KV_CACHE_DTYPES)} (got {unknown or 'none'})")
        if min(self.kv_cache_tokens, self.num_requests, self.prompt_len, self.output_len, self.accuracy_prompts,
               self.accuracy_tokens, self.repeats) < 1:  # fmt: skip
            raise ValueError("token counts and request counts must be >= 1")
