"""Engine configuration: frozen dataclasses validated once at construction. Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mmserve.errors import InvalidRequestError
from mmserve.request import SLO, ServiceClass
from mmserve.scheduler.policy import POLICIES

ADMISSION_MODES = ("off", "downgrade", "reject")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # the keys of kernels/fp8.py's KV_CACHE_DTYPES
QUANT_COMPUTE_CHOICES = ("auto", "dequantized", "native")  # models/quant/linear.py's compute paths, or auto
DEFAULT_INTERACTIVE_SLO = SLO(ttft_ms=1000.0, tbt_ms=100.0)  # a person chatting
DEFAULT_BATCH_SLO = SLO()  # throughput work: no target


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # tokens computed per step, over all requests
    max_num_seqs: int = 128  # requests running at once
    max_model_len: int = 4096  # prompt + output tokens of one request
    policy: str = "fcfs"
    max_num_encoder_tokens: int | None = None  # embedding tokens encoded per step; None: the token budget
    encoder_cache_size: int | None = (
        None  # embedding tokens held at once; None: 4x the encoder budget, >= 8192
    )
    chunk_encoder: bool = True  # encode a video's temporal groups only as the prefill reaches them
    # Tokens of max_num_batched_tokens that each embedding token the encoder computes in a step uses up
    # (its time over a decoder token's), so a step that encodes also prefills less and the longest step
    # stays near the others. 0: the encoder has only its own budget, max_num_encoder_tokens.
    encoder_token_cost: float = 0.0
    # A step that carries running decodes is sized so that its predicted time (the online step-time model,
    # scheduler/step_time.py) stays within this, whatever the model and the machine: the decodes' inter-token
    # time. Every chunking policy (fcfs, priority, slo) plans to it; max_num_batched_tokens stays the upper
    # bound. None: fixed token budgets only.
    max_step_ms: float | None = 250.0
    # Steps are planned to (1 - this) x their time target (max_step_ms, or slo's TBT), further divided by the
    # step-time model's measured error factor (a high quantile of measured / predicted).
    step_time_headroom: float = 0.1
    # -- the `slo` policy (scheduler/slo.py); other policies ignore these -------------------------
    interactive_slo: SLO = DEFAULT_INTERACTIVE_SLO  # class defaults, under a request's own targets
    batch_slo: SLO = DEFAULT_BATCH_SLO
    max_batch_decode_skips: int = 4  # a running batch decode waits at most this many steps in a row
    batch_min_share: float = 0.1  # of a step's tokens and predicted time, kept for batch work if any
    # TPOT is a mean: a stream ahead of its TBT pace (tokens so far x TBT > time since its first token)
    # may lend up to this much of its lead to one step, for a bigger prefill chunk. 0: every step fits
    # the TBT target (a bound on each inter-token gap, not only on their mean).
    tbt_slack_ms: float = 250.0
    batch_aging_ms: float = 30_000.0  # a batch request waiting this long is served like a late chat
    pin_after_preemptions: int = 2  # a request preempted this often is not evicted again ...
    pin_ms: float = 2_000.0  # ... for this long after its latest preemption
    admission_control: str = "off"  # "downgrade" | "reject" an interactive request whose TTFT cannot be met
    # JSON of StepTimeModel coefficients, a warm start (every policy sizes steps from it); None: the built-in prior
    step_time_model: str | None = None

    def __post_init__(self) -> None:
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_encoder_tokens is None:
            object.__setattr__(self, "max_num_encoder_tokens", self.max_num_batched_tokens)
        if self.encoder_cache_size is None:
            object.__setattr__(self, "encoder_cache_size", max(4 * self.max_num_encoder_tokens, 8192))
        _check_positive("max_num_encoder_tokens", self.max_num_encoder_tokens)
        _check_positive("encoder_cache_size", self.encoder_cache_size)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_model_len", self.max_model_len)
        if self.policy not in POLICIES:
            raise InvalidRequestError(
                f"scheduler_policy: must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}",
                param="scheduler_policy",
            )
        for name in ("interactive_slo", "batch_slo"):
            object.__setattr__(self, name, SLO.parse(getattr(self, name)) or SLO())
        _check_positive("max_batch_decode_skips", self.max_batch_decode_skips)
        _check_positive("pin_after_preemptions", self.pin_after_preemptions)
        for name in ("batch_min_share", "step_time_headroom"):
            share = getattr(self, name)
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not (0.0 <= share < 1.0):
                raise InvalidRequestError(f"{name}: must be a number in [0, 1), got {share!r}", param=name)
        for name in ("batch_aging_ms", "pin_ms", "tbt_slack_ms", "encoder_token_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0.0):
                raise InvalidRequestError(f"{name}: must be a number >= 0, got {value!r}", param=name)
        if self.max_step_ms is not None:
            value = self.max_step_ms
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0.0):
                raise InvalidRequestError(
                    f"max_step_ms: must be a number >= 0 (0: no time budget), got {value!r}", param="max_step_ms"
                )
            if value == 0:
                object.__setattr__(self, "max_step_ms", None)
        if self.admission_control not in ADMISSION_MODES:
            raise InvalidRequestError(
                f"admission_control: must be one of {', '.join(ADMISSION_MODES)}, got {self.admission_control!r}",
                param="admission_control",
            )

    def class_slo(self, service_class: ServiceClass) -> SLO:
        """The server's default targets for a class."""
        return self.interactive_slo if service_class == ServiceClass.INTERACTIVE else self.batch_slo


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False  # record what enters and leaves the prefix cache (`Scheduler.take_kv_events`)

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("num_kv_blocks", self.num_blocks)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{name}: must be an integer >= 1, got {value!r}", param=name)


@dataclass(frozen=True)
class KVEventsConfig:
    """Where the KV cache events go (vLLM's `--kv-events-config`, the same JSON keys and defaults): a ZeroMQ
    PUB socket at `endpoint`, and with `replay_endpoint` a ROUTER socket that resends the last `buffer_steps`
    batches from a given sequence number. A subscriber (vllm-router's `kv_aware` policy) connects to both."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the sending thread; beyond it the oldest is dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise InvalidRequestError(
                f"kv_events_config.enable_kv_cache_events: must be true or false, got {self.enable_kv_cache_events!r}",
                param="kv_events_config",
            )
        if not isinstance(self.topic, str):
            raise InvalidRequestError(
                f"kv_events_config.topic: must be a string, got {self.topic!r}", param="kv_events_config"
            )
        if self.publisher not in (None, "zmq", "null"):
            raise InvalidRequestError(
                f"kv_events_config.publisher: must be 'zmq' or 'null', got {self.publisher!r}", param="kv_events_config"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(
                    f"kv_events_config.{name}: must be an integer >= 1, got {getattr(self, name)!r}",
                    param="kv_events_config",
                )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.partition("://")[0] in ("tcp", "ipc", "inproc")):
                raise InvalidRequestError(
                    f"kv_events_config.{name}: must be a ZeroMQ address such as tcp://*:5557, got {value!r}",
                    param="kv_events_config",
                )

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and sent: enabled, and a publisher that sends."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The `--kv-events-config` value: a JSON object of the fields above; unknown keys are refused."""
        return cls(**_json_object("kv_events_config", text, set(cls.__dataclass_fields__)))


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's `--kv-transfer-config`, the same JSON keys): the connector (only
    "NixlConnector"), this instance's role, its engine id, what a decode instance does when a read fails
    (`kv_load_failure_policy`: fail the request, or prefill it here) and `kv_connector_extra_config`:

    - `side_channel_host` / `side_channel_port`: where this instance's NIXL handshake side channel listens (and
      what it tells decode instances); else $VLLM_NIXL_SIDE_CHANNEL_HOST / $VLLM_NIXL_SIDE_CHANNEL_PORT, else
      localhost:5600 (vLLM's defaults);
    - `kv_lease_duration`: seconds a prefill instance keeps a finished request's blocks for a decode instance
      that never reads them (30);
    - `kv_load_timeout`: seconds a decode instance waits for a handshake and read before the failure policy (30);
    - `backends`: NIXL backends (["UCX"]);
    - `progress_thread`: whether NIXL runs its own progress thread (mmserve's key). Default: on for a GPU KV pool,
      off for a CPU one, whose engine steps drive the transfers instead: UCX's progress thread polls without
      pause and would take a core from the engine that shares the machine with it.
    """

    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None  # None: a fresh uuid per start
    kv_buffer_device: str | None = None  # vLLM's; the KV pool is the buffer here, on the engine's device
    kv_connector_extra_config: dict[str, object] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"kv_transfer_config.{name}: {message}", param="kv_transfer_config")

        if self.kv_connector != "NixlConnector":
            raise bad("kv_connector", f"only 'NixlConnector' is supported, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise bad("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.engine_id is not None and not (isinstance(self.engine_id, str) and self.engine_id):
            raise bad("engine_id", f"must be a non-empty string, got {self.engine_id!r}")
        if self.kv_buffer_device not in (None, "cpu", "cuda"):
            raise bad("kv_buffer_device", f"must be 'cpu' or 'cuda', got {self.kv_buffer_device!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise bad(
                "kv_load_failure_policy",
                f"must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}",
            )
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise bad("kv_connector_extra_config", "must be an object")
        known = {"side_channel_host", "side_channel_port", "kv_lease_duration", "kv_load_timeout", "backends",
                 "progress_thread"}  # fmt: skip
        unknown = sorted(set(extra) - known)
        if unknown:
            raise bad("kv_connector_extra_config", f"unknown field(s) {', '.join(unknown)}")
        port = self.side_channel_port
        if not isinstance(port, int) or isinstance(port, bool) or not (0 < port < 65536):
            raise bad("kv_connector_extra_config.side_channel_port", f"must be a port number, got {port!r}")
        for name in ("kv_lease_duration", "kv_load_timeout"):
            value = extra.get(name, 30.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise bad(f"kv_connector_extra_config.{name}", f"must be a number of seconds > 0, got {value!r}")
        if extra.get("progress_thread") not in (None, True, False):
            raise bad("kv_connector_extra_config.progress_thread", f"must be true or false, got "
                      f"{extra['progress_thread']!r}")  # fmt: skip
        backends = self.backends
        if not (isinstance(backends, list) and backends and all(isinstance(b, str) for b in backends)):
            raise bad("kv_connector_extra_config.backends", f"must be a list of NIXL backend names, got {backends!r}")

    @property
    def side_channel_host(self) -> str:
        """Where decode instances reach this one's handshake side channel (what `remote_host` says)."""
        host = self.kv_connector_extra_config.get("side_channel_host")
        return str(host or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost")

    @property
    def side_channel_port(self) -> int:
        port = self.kv_connector_extra_config.get("side_channel_port")
        if port is None:
            port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 5600)
        return port  # type: ignore[return-value]

    @property
    def kv_lease_duration(self) -> float:
        return float(self.kv_connector_extra_config.get("kv_lease_duration", 30.0))  # type: ignore[arg-type]

    @property
    def kv_load_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("kv_load_timeout", 30.0))  # type: ignore[arg-type]

    @property
    def backends(self) -> list[str]:
        return self.kv_connector_extra_config.get("backends", ["UCX"])  # type: ignore[return-value]

    @property
    def progress_thread(self) -> bool | None:
        """None: decided by where the KV pool is (on for a GPU, off for the CPU)."""
        return self.kv_connector_extra_config.get("progress_thread")  # type: ignore[return-value]

    @property
    def is_producer(self) -> bool:
        """Serves `do_remote_decode` requests (a prefill instance)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Serves `do_remote_prefill` requests (a decode instance)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """The `--kv-transfer-config` value: a JSON object of the fields above; unknown keys are refused."""
        return cls(**_json_object("kv_transfer_config", text, set(cls.__dataclass_fields__)))


EC_ROLES = ("ec_producer", "ec_consumer")


@dataclass(frozen=True)
class ECTransferConfig:
    """Encoder disaggregation (vLLM's `--ec-transfer-config`, the same JSON keys) over a shared directory
    (vLLM's "ECExampleConnector"): an `ec_producer` (encoder) instance stores every temporal group it encodes
    under `ec_connector_extra_config.shared_storage_path`, keyed by `mm_hash` and group; an `ec_consumer`
    (prefill) instance loads a stored group into its encoder cache instead of running its vision tower."""

    ec_connector: str = "ECExampleConnector"
    ec_role: str = "ec_consumer"
    engine_id: str | None = None  # vLLM's; a shared directory needs none
    ec_buffer_device: str | None = None
    ec_connector_extra_config: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"ec_transfer_config.{name}: {message}", param="ec_transfer_config")

        if self.ec_connector != "ECExampleConnector":
            raise bad("ec_connector", f"only 'ECExampleConnector' (a shared directory) is supported, got "
                      f"{self.ec_connector!r}")  # fmt: skip
        if self.ec_role not in EC_ROLES:
            raise bad("ec_role", f"must be one of {', '.join(EC_ROLES)}, got {self.ec_role!r}")
        if self.ec_buffer_device not in (None, "cpu", "cuda"):
            raise bad("ec_buffer_device", f"must be 'cpu' or 'cuda', got {self.ec_buffer_device!r}")
        extra = self.ec_connector_extra_config
        if not isinstance(extra, dict):
            raise bad("ec_connector_extra_config", "must be an object")
        unknown = sorted(set(extra) - {"shared_storage_path"})
        if unknown:
            raise bad("ec_connector_extra_config", f"unknown field(s) {', '.join(unknown)}")
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise bad("ec_connector_extra_config.shared_storage_path", f"must be a directory, got {path!r}")

    @property
    def shared_storage_path(self) -> str:
        return str(self.ec_connector_extra_config["shared_storage_path"])

    @property
    def is_producer(self) -> bool:
        return self.ec_role == "ec_producer"

    @classmethod
    def from_json(cls, text: str) -> ECTransferConfig:
        """The `--ec-transfer-config` value: a JSON object of the fields above; unknown keys are refused."""
        return cls(**_json_object("ec_transfer_config", text, set(cls.__dataclass_fields__)))


def _json_object(param: str, text: str, known: set[str]) -> dict[str, object]:
    """A command-line JSON object whose keys must all be `known` (a config dataclass's fields)."""
    import json

    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: not JSON ({exc})", param=param) from None
    if not isinstance(fields, dict):
        raise InvalidRequestError(f"{param}: must be a JSON object", param=param)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequestError(f"{param}: unknown field(s) {', '.join(unknown)}", param=param)
    return fields


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets when starting an engine; resolved against the checkpoint by `EngineCore`."""

    model: str
    device: str | None = None  # None: cuda when available, else cpu
    # float32 | bfloat16 | float16 | auto (bf16 on CUDA and on CPUs with native bf16, else fp32); None:
    # $MMSERVE_DTYPE, else auto (engine/device.py).
    dtype: str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV pool; ignored when num_kv_blocks is set
    # The KV cache's element type: "auto" (the compute dtype), "fp8" / "fp8_e4m3" (e4m3fn) or "fp8_e5m2": one
    # byte per value, scaled per KV head by the checkpoint's k_scale / v_scale (1.0 where it has none).
    kv_cache_dtype: str = "auto"
    # FP8 cache: set each layer's scales from the first step's K/V instead (vLLM's calculate_kv_scales).
    calculate_kv_scales: bool = False
    # A quantized checkpoint's compute path: "auto", "dequantized" (full weights at load) or "native" (codes kept);
    # None: $MMSERVE_QUANT_COMPUTE, else auto. See models/quant/linear.py.
    quant_compute: str | None = None
    # Decode steps: replayed from CUDA graphs captured per batch size on a CUDA device with the Triton attention
    # (engine/decode_graphs.py), unless enforce_eager; the sizes captured (None: 1, 2, 4, then multiples of 8
    # up to max_num_seqs, at most 512), as vLLM's --enforce-eager / --cuda-graph-sizes.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    scheduler_policy: str = "fcfs"
    max_model_len: int | None = None
    max_num_encoder_tokens: int | None = None  # None: max_num_batched_tokens
    encoder_cache_size: int | None = None  # None: 4x the encoder budget, at least 8192
    chunk_encoder: bool = True  # False: encode each media item whole, as vLLM does
    encoder_token_cost: float = 0.0  # budget tokens per encoded embedding token; see SchedulerConfig
    # Steps carrying running decodes are sized to stay within this (see SchedulerConfig.max_step_ms); 0 or None:
    # fixed token budgets only.
    max_step_ms: float | None = SchedulerConfig.max_step_ms
    # -- the `slo` policy (scheduler_policy="slo"; the others ignore these) --------------------------
    # Server defaults of the interactive class; a request's own `slo` overrides them field by field.
    # None: no target of that kind. Batch requests have no default target.
    interactive_ttft_ms: float | None = DEFAULT_INTERACTIVE_SLO.ttft_ms
    interactive_tbt_ms: float | None = DEFAULT_INTERACTIVE_SLO.tbt_ms
    admission_control: str = "off"  # "downgrade" | "reject" (429) a chat whose TTFT cannot be met
    # A warm start for the online step-time model every policy sizes steps from (JSON written by `mmserve bench
    # profile`); None: the built-in prior.
    step_time_model: str | None = None
    max_batch_decode_skips: int = SchedulerConfig.max_batch_decode_skips
    batch_min_share: float = SchedulerConfig.batch_min_share
    step_time_headroom: float = SchedulerConfig.step_time_headroom  # steps planned to (1 - this) x their target
    tbt_slack_ms: float = SchedulerConfig.tbt_slack_ms  # a stream's lead on its TBT pace lent to one step
    # -- tensor parallelism ---------------------------------------------------------------------------------
    tensor_parallel_size: int = 1  # ranks one model is split over (processes; gloo on the CPU, NCCL on CUDA)
    # A collective that waits longer than this for a rank fails, and the engine stops (a hung rank).
    distributed_timeout_s: float = 300.0
    # Ranks started on this machine (ranks 0..local-1); the rest join from other nodes through the
    # rendezvous store at master_addr:master_port (torchrun's MASTER_ADDR / MASTER_PORT). None: all.
    tensor_parallel_local_ranks: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (every rank is local)
    # The vision tower over the ranks: "data" (replicated; the step's media split over the ranks) or
    # "weights" (each block sharded like the decoder, for towers too large to replicate).
    mm_encoder_tp_mode: str = "data"
    # -- replicas ---------------------------------------------------------------------------------------------
    kv_events_config: KVEventsConfig | None = None  # publish what the prefix cache holds (for routers)
    # Prefill/decode disaggregation over NIXL (vLLM's protocol); None: off.
    kv_transfer_config: KVTransferConfig | None = None
    # Encoder disaggregation over a shared directory (vLLM's protocol); None: off.
    ec_transfer_config: ECTransferConfig | None = None

    def __post_init__(self) -> None:
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InvalidRequestError(
                f"device: must be 'cpu', 'cuda' or None, got {self.device!r}", param="device"
            )
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(
                f"dtype: must be 'auto', 'float32', 'bfloat16', 'float16' or None, got {self.dtype!r}", param="dtype"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise InvalidRequestError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}",
                param="kv_cache_dtype",
            )
        if self.quant_compute is not None and self.quant_compute not in QUANT_COMPUTE_CHOICES:
            raise InvalidRequestError(
                f"quant_compute: must be one of {', '.join(QUANT_COMPUTE_CHOICES)} or None, got {self.quant_compute!r}",
                param="quant_compute",
            )
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        sizes = self.cuda_graph_sizes
        if sizes is not None and not (
            isinstance(sizes, (tuple, list))
            and sizes
            and all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 512 for s in sizes)
        ):
            raise InvalidRequestError(
                f"cuda_graph_sizes: must be batch sizes in 1..512, got {sizes!r}", param="cuda_graph_sizes"
            )
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.mm_encoder_tp_mode not in ("data", "weights"):
            raise InvalidRequestError(
                f"mm_encoder_tp_mode: must be 'data' or 'weights', got {self.mm_encoder_tp_mode!r}",
                param="mm_encoder_tp_mode",
            )
        local = self.tensor_parallel_local_ranks
        if local is not None and not (isinstance(local, int) and 1 <= local <= self.tensor_parallel_size):
            raise InvalidRequestError(
                f"tensor_parallel_local_ranks: must be in 1..tensor_parallel_size, got {local!r}",
                param="tensor_parallel_local_ranks",
            )
        if local is not None and local < self.tensor_parallel_size and not self.master_port:
            raise InvalidRequestError(
                "master_port: ranks on other nodes need a fixed rendezvous port (MASTER_PORT)",
                param="master_port",
            )
        timeout = self.distributed_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise InvalidRequestError(
                f"distributed_timeout_s: must be a number > 0, got {timeout!r}", param="distributed_timeout_s"
            )
        # Fail on bad scheduler / cache values (and an unreadable step-time model) before any weights load.
        self.scheduler_config(SchedulerConfig.max_model_len)
        if self.step_time_model is not None:
            _check_step_time_model(self.step_time_model)
        CacheConfig(self.block_size, self.num_kv_blocks or 1, self.enable_prefix_caching)
        events = self.kv_events_config
        if events is not None and events.enabled and not self.enable_prefix_caching:
            raise InvalidRequestError(
                "kv_events_config: KV events announce prefix-cache blocks; they need prefix caching on",
                param="kv_events_config",
            )
        for name in ("kv_transfer_config", "ec_transfer_config"):
            if getattr(self, name) is not None and self.tensor_parallel_size > 1:
                raise InvalidRequestError(
                    f"{name}: disaggregation runs on one rank per instance (tensor_parallel_size 1) for now",
                    param=name,
                )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's configuration, once `max_model_len` is resolved against the checkpoint."""
        return SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            max_model_len,
            policy=self.scheduler_policy,
            max_num_encoder_tokens=self.max_num_encoder_tokens,
            encoder_cache_size=self.encoder_cache_size,
            chunk_encoder=self.chunk_encoder,
            encoder_token_cost=self.encoder_token_cost,
            max_step_ms=self.max_step_ms,
            interactive_slo=SLO(self.interactive_ttft_ms, self.interactive_tbt_ms),
            max_batch_decode_skips=self.max_batch_decode_skips,
            batch_min_share=self.batch_min_share,
            step_time_headroom=self.step_time_headroom,
            tbt_slack_ms=self.tbt_slack_ms,
            admission_control=self.admission_control,
            step_time_model=self.step_time_model,
        )


def _check_step_time_model(path: str) -> None:
    """A missing or malformed calibration file is a start-up error, not a crash on the first request."""
    from mmserve.scheduler.step_time import StepTimeModel  # torch-free, but only needed here

    try:
        StepTimeModel.load(path)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"step_time_model: cannot load {path!r} ({type(exc).__name__}: {exc})", param="step_time_model"
        ) from None
