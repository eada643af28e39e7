"""What the engine core says: the value one `step()` returns and the facts its handshake reports.

Plain frozen dataclasses of torch-free fields, so the same values serve the in-process core and cross
the process boundary (`engine/serial.py` encodes them with msgspec).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config import SchedulerConfig
from mmserve.scheduler.output import EngineCoreOutput
from mmserve.scheduler.scheduler import SchedulerStats


@dataclass(frozen=True)
class StepRecord:
    """One executed step: its wall time and what it computed."""

    duration_s: float
    encoder_duration_s: float  # of duration_s, spent in the vision encoder
    num_decode_tokens: int
    num_prefill_tokens: int
    num_encoder_tokens: float  # a slice of the tower counts by its share of the blocks
    # The rest of the step-time model's features (scheduler/step_time.py), for `mmserve bench profile`.
    num_seqs: int = 0
    num_context_tokens: int = 0  # sum over scheduled requests of (cached + new) tokens attended to
    forward_duration_s: float = 0.0  # of duration_s: decoder forward + logits (batch building included)
    sampling_duration_s: float = 0.0  # of duration_s: sampling and the host copy of its results
    comm_bytes: int = 0  # bytes the first tensor-parallel rank put into collectives (0 with one rank)
    grammar_duration_s: float = 0.0  # of duration_s: filling token bitmasks and advancing grammar matchers


@dataclass(frozen=True)
class CoreLoopStats:
    """Where the engine-core process's loop has spent its wall time since it started (cumulative).

    step_s: inside `EngineCore.step()` (the model and the scheduler); io_s: decoding and handling the
    front ends' messages and encoding and sending outputs; idle_s: waiting with nothing to do.
    """

    step_s: float = 0.0
    io_s: float = 0.0
    idle_s: float = 0.0
    num_steps: int = 0  # steps whose outputs were published
    bytes_out: int = 0  # encoded bytes of every message sent to the front ends (frames included)


@dataclass(frozen=True)
class EngineCoreOutputs:
    """Everything one step produced: per-request outputs (failed requests included, with their error),
    the scheduler's counters after the step, and the step's record (None when nothing ran). `loop`: the
    core process's loop times so far (None for an in-process core driven by its caller)."""

    outputs: tuple[EngineCoreOutput, ...]
    stats: SchedulerStats
    step: StepRecord | None = None
    loop: CoreLoopStats | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the core reports once it is ready: the limits the front end validates against, and the
    figures of the start-up banner."""

    model: str  # the resolved checkpoint directory
    max_model_len: int
    scheduler_config: SchedulerConfig
    device: str
    dtype: str
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int  # on each rank
    tensor_parallel_size: int = 1
    weight_bytes: int = 0  # on each rank
    kv_cache_dtype: str = "float32"  # fp8_e4m3, fp8_e5m2, or the compute dtype's name
    # Disaggregation: "<kv_role> as engine <engine_id>, NIXL side channel on <host>:<port>"; None: off.
    disaggregation: str | None = None
    decode_graph_mode: str = "off"  # "cuda": decode steps replayed from CUDA graphs; "static": the test mode
    decode_graph_sizes: tuple[int, ...] = ()  # the batch sizes captured
    decode_stack: bool = False  # CPU decode-only steps run the decoder as one C call (kernels/cpu_decoder.py)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token takes on each rank (all layers, K and V)."""
        return self.kv_cache_bytes / max(1, self.num_kv_tokens)

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the KV pool holds at once."""
        return self.num_kv_tokens / self.max_model_len

    @property
    def _ranks(self) -> str:
        return f" x {self.tensor_parallel_size} tensor-parallel ranks" if self.tensor_parallel_size > 1 else ""

    @property
    def _per_rank(self) -> str:
        return " per rank" if self.tensor_parallel_size > 1 else ""

    def banner(self) -> str:
        return (
            f"engine: {self.dtype} on {self.device}{self._ranks} (attention: {self.attention_backend}); KV pool "
            f"{self.num_kv_blocks} blocks x {self.block_size} tokens = {self.num_kv_tokens} tokens "
            f"({self.kv_cache_dtype}), {self.kv_cache_bytes / 2**20:.1f} MiB{self._per_rank}; weights {self.weight_bytes / 2**20:.1f} MiB"
            f"{self._per_rank}; max_model_len {self.max_model_len}: "
            f"{self.max_concurrency:.2f}x concurrency at full length"
            + (f"; disaggregation: {self.disaggregation}" if self.disaggregation else "")
            + (f"; decode graphs ({self.decode_graph_mode}) at {len(self.decode_graph_sizes)} batch sizes "
               f"{self.decode_graph_sizes[0]}-{self.decode_graph_sizes[-1]}" if self.decode_graph_sizes else "")
            + ("; decode steps: one C call" if self.decode_stack else "")
        )
