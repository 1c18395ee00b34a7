"""Engine configuration: frozen dataclasses validated once, at the edge (CLI or `paphos.LLM`).

Every component takes only the sub-config it uses. Values that depend on the model (for example
`max_model_len` when the user gives none) are resolved by the loader and written back with
`dataclasses.replace`, so a config object is never mutated after validation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# How matmuls with GGUF-quantized weights round their activations (see paphos/quant/gguf).
GGUF_NUMERICS = ("float", "llamacpp")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
# --quantization (Aphrodite's name, -q): the weight format; None = chosen from the model (its
# GGUF header or config.json). An explicit value must match the model, except fp8 on an
# unquantized one (quantized at load); the *_marlin names are Aphrodite's for the same checkpoints
# (paphos/quant/registry.py reconciles them at load).
QUANTIZATIONS = ("gguf", "gptq", "gptq_marlin", "marlin", "awq", "awq_marlin", "compressed-tensors", "fp8", "exl2")
# --max-lora-rank values (Aphrodite's list): slot tensors are padded to this rank.
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# --lora-dtype: auto = the model's dtype; float32 is ours (exact CPU parity runs).
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag at fault."""


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    served_model_name: tuple[str, ...] = ()
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    chat_template: str | None = None
    max_logprobs: int = 20
    device: str = "auto"
    # On a GPU: no CUDA graphs; on the CPU: no compiled decode step (worker/compiled_decode.py).
    enforce_eager: bool = False
    # CPU threads of the engine core's matmuls and compiled kernels (llama.cpp's -t); None: torch's
    # default, one per physical core.
    threads: int | None = None
    gguf_numerics: str = "float"
    # auto: Triton paged kernels on a GPU, the torch reference elsewhere.
    attention_backend: str = "auto"
    quantization: str | None = None
    # Hugging Face repo ids in `model` / `tokenizer` (paphos/loader/hub.py): the branch, tag or
    # commit of each, and the cache to download into (None: huggingface_hub's own).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.gguf_numerics not in GGUF_NUMERICS:
            raise ConfigError(
                f"--gguf-numerics must be one of {', '.join(GGUF_NUMERICS)}, got {self.gguf_numerics!r}"
            )
        if self.max_logprobs < 0:
            raise ConfigError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        self._resolve_hub_ids()
        self._check_quantization()

    def _resolve_hub_ids(self) -> None:
        """Repo ids become local paths here, once, in the process that reads the flags: the engine
        core (another process) and the loader only ever see paths, and a repo that cannot be had
        is a ConfigError at start-up. A no-op for local paths, so `dataclasses.replace` is cheap."""
        from paphos.loader.hub import resolve_model, resolve_tokenizer

        model = resolve_model(
            self.model, revision=self.revision, download_dir=self.download_dir, load_format=self.load_format
        )
        tokenizer = self.tokenizer and resolve_tokenizer(
            self.tokenizer, revision=self.tokenizer_revision, download_dir=self.download_dir
        )
        # Frozen, but still being validated: nothing has read this config yet. Clients keep
        # seeing the id that was typed, not a cache path.
        if model != self.model:
            object.__setattr__(self, "served_model_name", self.served_model_name or (self.model,))
            object.__setattr__(self, "model", model)
        if tokenizer != self.tokenizer:
            object.__setattr__(self, "tokenizer", tokenizer)

    def _check_quantization(self) -> None:
        """--quantization names a format we have and, when the model path exists, its own."""
        q = self.quantization
        if q is None:
            return
        if q not in QUANTIZATIONS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANTIZATIONS)} (or omitted: chosen from the "
                f"model), got {q!r}"
            )
        from paphos.loader.base import LoaderError
        from paphos.loader.source import detect_format

        try:
            fmt = detect_format(self.model, self.load_format)
        except LoaderError:
            return  # a missing or unreadable model is the loader's error, reported with its path
        if (fmt == "gguf") != (q == "gguf") or (fmt == "dummy" and q != "fp8"):
            what = "dummy weights" if fmt == "dummy" else f"a {fmt} model"
            raise ConfigError(f"--quantization {q} given, but {self.model} is {what}")

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_name or (self.model,)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92
    kv_cache_dtype: str = "auto"
    # KV budget when the cache lives in host memory (the CPU path): GiB for all layers together.
    cpu_kv_cache_gb: float = 4.0
    # Forces the number of KV blocks (tests, benchmarks); None sizes the cache from the budget.
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.cpu_kv_cache_gb <= 0:
            raise ConfigError(f"--cpu-kv-cache-gb must be > 0, got {self.cpu_kv_cache_gb}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("--num-gpu-blocks-override must be >= 2 (block 0 is reserved)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None = auto, resolved by worker/setup.py once the device is known: 8192 on a GPU, where a
    # burst of long prompts would otherwise prefill at a fraction of the GPU's rate (1000 arriving
    # 1000-token prompts prefilled at ~15k tok/s with 2048 on an H200, ~37k with 8192), and 2048
    # on the CPU, where a bigger step only delays the decode rows that share it.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Filled in from the model once it is known; the scheduler reads it for length checks.
    max_model_len: int = 2048
    # Launch the next decode step of a graph-replayed batch before the current one is read back,
    # with each decoding request's next KV block allocated a step early (worker/lookahead.py).
    # None = auto: on wherever decode steps replay CUDA graphs (resolved by worker/setup.py).
    decode_lookahead: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if (
            not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "--max-num-batched-tokens must be >= --max-model-len when chunked prefill is off "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True)
class ParallelConfig:
    # -tp N: the model's heads, MLP and vocabulary split over N ranks, one process each (rank 0 in
    # the engine core); docs/tensor-parallel.md. Whether the model splits N ways is checked once
    # its config is read (worker/tensor_parallel.py `check_tensor_parallel`).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: an adapter registered at start-up."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    # Adapters resident on the device at once: the most distinct adapters one step may use.
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept in host memory (LRU); None = max_loras.
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ConfigError(
                f"--max-lora-rank must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})"
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.fully_sharded_loras:
            # Each rank holds its slice of B (column-parallel) or of A (row-parallel) and the rest
            # whole; sharding that too would cost a collective per projection.
            raise ConfigError("--fully-sharded-loras is not supported (with -tp N each rank holds its slice of each adapter)")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        names = [m.name for m in self.lora_modules]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ConfigError(f"--lora-modules: the name {duplicate!r} is given twice")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 2242
    uvicorn_log_level: str = "info"
    disable_log_requests: bool = False
    return_tokens_as_token_ids: bool = False
    # Upper bound on n / best_of per request: a guard against one request occupying the engine.
    max_n: int = 128
    # Requests admitted but not yet scheduled, at most; more are refused with 429 + Retry-After.
    max_num_waiting: int | None = 1024
    # Seconds from a request's arrival to its last token, queue included (None: no limit); past
    # it the request is aborted: 504 before its first token, an error event after.
    request_timeout_s: float | None = None
    # On SIGTERM / Ctrl-C: seconds in-flight requests get to finish before they are aborted.
    shutdown_timeout_s: float = 5.0
    # Auth (contract §2.1): user keys for /v1/* and /api/*, the admin key for admin routes. Kept
    # out of repr so a logged config never shows them.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_key: str | None = field(default=None, repr=False)
    # CORS (contract §2.2).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Logging: the periodic stats line, and how much of a prompt a request log line shows
    # (characters or token ids; None = all of it).
    disable_log_stats: bool = False
    stats_interval_s: float = 10.0
    max_log_len: int | None = None
    # Kobold API: default `max_length`, also reported by /api/v1/config/max_length.
    kobold_default_max_length: int = 200
    # TLS and reverse-proxy prefix, handed to uvicorn.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    root_path: str = ""
    # No /docs, /redoc, /openapi.json.
    disable_fastapi_docs: bool = False
    # No web page at / (paphos/server/web).
    disable_web_ui: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if any(not key for key in self.api_keys):
            raise ConfigError("--api-keys: a key must not be empty")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise ConfigError(f"--max-num-waiting must be >= 1 (or -1 for no bound), got {self.max_num_waiting}")
        if self.admin_key == "":
            raise ConfigError("--admin-key must not be empty")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.kobold_default_max_length < 1:
            raise ConfigError(f"--kobold-default-max-length must be >= 1, got {self.kobold_default_max_length}")
        if self.stats_interval_s <= 0:
            raise ConfigError(f"the stats interval must be > 0, got {self.stats_interval_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        if tp > 1 and self.scheduler.decode_lookahead:
            # The lookahead replays rank 0's next graph before the step is read back; the other
            # ranks would have to replay theirs at the same moment.
            raise ConfigError(f"--decode-lookahead with --tensor-parallel-size {tp} is not supported yet")

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The config once the model's context length is known (resolved by the loader)."""
        batched = self.scheduler.max_num_batched_tokens
        if not self.scheduler.enable_chunked_prefill:
            batched = max(batched or 0, max_model_len)
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, max_model_len=max_model_len),
            scheduler=dataclasses.replace(
                self.scheduler, max_model_len=max_model_len, max_num_batched_tokens=batched
            ),
        )
