"""Engine start-up on the worker side: model path -> loaded model, KV cache and ModelRunner.

Data flow: EngineConfig -> loader.load_model_source (config, tokenizer, eos ids, context length)
-> models.registry (model class) -> weights streamed into the model -> KV cache sized from the
memory budget -> ModelRunner. Returns the EngineConfig with model-derived values filled in.

With `-tp N` (tensor_parallel.py) the engine core's call is rank 0: once the model is known to
split N ways it starts the other ranks, whose processes run this same function with their
`TPRank` up to the warm-up (rank 0's warm-up steps reach them as ordinary steps). Every rank
builds the model sharded (layers/parallel.py), loads its slices and sizes its KV cache; the
ranks then keep the smallest block count.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace

import torch

from paphos.attention.backend import AttentionBackend
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.config import ConfigError, EngineConfig
from paphos.default_model import default_cache_dir
from paphos.layers import parallel
from paphos.loader import ModelSource, load_model_source
from paphos.lora.host_cache import AdapterHostCache
from paphos.lora.slots import AdapterSlots, rank_slices
from paphos.lora.spec import LoRAModelSpec, lora_model_spec
from paphos.models.registry import resolve_model_class
from paphos.quant import kv_cache as quant_kv
from paphos.quant.gguf.kernels import INT8_GROUPS_ON_CPU
from paphos.quant.kernels import compiled_dequant
from paphos.quant.registry import select_quant_config
from paphos.sample.guided import tokenizer_info
from paphos.tokenizer import Tokenizer
from paphos.worker.compiled_decode import use_persistent_cache
from paphos.worker.kv_cache import KVCacheSpec, num_blocks_for_budget
from paphos.worker.model_runner import ModelRunner
from paphos.worker.profiling import profile_kv_budget
from paphos.worker.tensor_parallel import TPDriver, TPRank, check_tensor_parallel, rank_device
from paphos.worker.warmup import warm_up_adapter_kernels, warm_up_mixed_steps, warm_up_prefill

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class Worker:
    config: EngineConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    vocab_size: int
    num_blocks: int
    # With LoRA enabled: what adapters must fit, and their host cache (the runner holds the slots).
    lora_spec: LoRAModelSpec | None = None
    adapters: AdapterHostCache | None = None
    # Rank 0 of a tensor-parallel group: the other ranks' supervisor (closed with the engine).
    tp: TPDriver | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device: {exc}") from exc


def resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        # With native bf16 dot products (AVX512-BF16, AMX) bf16 halves the memory traffic that bounds
        # decode and doubles GEMM throughput (measured 2x decode, 2.3x prefill on SmolLM2); without
        # them bf16 is emulated and slower than float32.
        native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.bfloat16 if native_bf16 else torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return torch.float16 if config_dtype == torch.float16 else torch.bfloat16


def load_worker(config: EngineConfig, member: TPRank | None = None) -> Worker:
    """The engine core's worker (rank 0), or with `member` a tensor-parallel follower's."""
    model_config = config.model
    source = load_model_source(
        model_config.model,
        load_format=model_config.load_format,
        tokenizer=model_config.tokenizer,
        chat_template=model_config.chat_template,
    )
    if source.tokenizer is None:
        raise ConfigError(f"{source.path}: no tokenizer found; pass --tokenizer")
    logger.info("loading %s", source.description)

    max_model_len = model_config.max_model_len or source.max_model_len
    if max_model_len > source.max_model_len:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's context length {source.max_model_len}"
        )
    config = config.with_max_model_len(max_model_len)

    device = resolve_device(model_config.device)
    tp_size = config.parallel.tensor_parallel_size
    if tp_size > 1:
        device = rank_device(device, member.rank if member is not None else 0)
    if config.scheduler.max_num_batched_tokens is None:
        batched = 8192 if device.type == "cuda" else 2048
        config = replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=batched))
    backend = _attention_backend(config, device)
    dtype = resolve_dtype(model_config.dtype, source.hf_config, device)
    kv_dtype = _kv_cache_dtype(config, backend, dtype)
    torch.manual_seed(model_config.seed)
    if model_config.threads is not None:
        torch.set_num_threads(model_config.threads)
    elif tp_size > 1 and device.type == "cpu":
        # The ranks share the machine's cores: one rank per core set, not N ranks on every core.
        torch.set_num_threads(max(1, torch.get_num_threads() // tp_size))
    if device.type == "cpu":
        logger.info("CPU threads: %d", torch.get_num_threads())
    model_cls = resolve_model_class(source.hf_config)
    quant_config = select_quant_config(source, model_config.quantization, model_config.gguf_numerics)
    driver = None
    if tp_size > 1 and member is None:  # rank 0: check the split once, then start the others
        check_tensor_parallel(config, source, quant_config, device)
        driver = TPDriver.start(config, device)
    try:
        return _build(config, source, device, backend, dtype, kv_dtype, model_cls, quant_config, driver or member)
    except BaseException:
        if driver is not None:
            driver.close()
        raise


def _build(
    config: EngineConfig, source: ModelSource, device: torch.device, backend: AttentionBackend,
    dtype: torch.dtype, kv_dtype: torch.dtype, model_cls: type[torch.nn.Module], quant_config: object,
    member: TPRank | None,
) -> Worker:  # fmt: skip
    """The model, its KV cache and runner (on every tensor-parallel rank)."""
    model_config, max_model_len = config.model, config.scheduler.max_model_len
    is_driver = member is None or isinstance(member, TPDriver)
    with torch.device(device), parallel.building(member.tp if member is not None else parallel.SINGLE):
        model = model_cls(
            source.hf_config, dtype=dtype, attn_backend=backend, quant_config=quant_config
        )
    compile_decode = device.type == "cpu" and not model_config.enforce_eager and cpu_compile_enabled()
    if compile_decode and config.lora.enable_lora:
        logger.info("compiled CPU decode off: LoRA steps run eagerly on the CPU")
        compile_decode = False
    if compile_decode and member is not None:
        # A compiled graph would have to trace the collectives; the eager step runs them.
        logger.info("compiled CPU decode off: tensor-parallel steps run eagerly on the CPU")
        compile_decode = False
    int8_groups = INT8_GROUPS_ON_CPU.set(compile_decode)
    try:
        source.load_into(model, seed=model_config.seed, show_progress=is_driver)
    finally:
        INT8_GROUPS_ON_CPU.reset(int8_groups)
    model.eval()
    if member is not None:
        member.barrier()  # every rank loaded: the profiling pass's collectives meet at once
    for line in getattr(quant_config, "summary", list)():
        logger.info("%s", line)
    kv_line = quant_kv.startup_line(model, quant_config, kv_dtype)
    if kv_line is not None:
        (logger.warning if kv_line[1] else logger.info)("%s", kv_line[0])
    adapter_slots = _attach_lora(model, config, dtype, device, member) if config.lora.enable_lora else None

    kv_spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype)
    num_blocks = num_blocks_for_budget(kv_spec, config.cache, _kv_budget_bytes(model, config, kv_spec, device))
    if member is not None:
        num_blocks = member.agree_min(num_blocks)  # each rank holds its heads of every block
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s)",
        num_blocks - 1, config.cache.block_size, (num_blocks - 1) * config.cache.block_size,
        num_blocks * kv_spec.bytes_per_block(config.cache.block_size) / (1 << 30), device,
    )
    eos_ids = source.eos_token_ids
    graphs = device.type == "cuda" and not model_config.enforce_eager and backend.name == "triton"
    if device.type == "cuda" and not model_config.enforce_eager and not graphs:
        logger.info("CUDA graphs off: the %s attention backend cannot be captured", backend.name)
    if config.scheduler.decode_lookahead is None:
        # The lookahead replays graphs only; elsewhere its early block allocation would buy nothing.
        # Not with tensor parallelism: every rank would have to replay its next graph early.
        config = replace(config, scheduler=replace(config.scheduler, decode_lookahead=graphs and member is None))
    runner = ModelRunner(
        model, kv_spec, num_blocks, config.cache.block_size, device, model.vocab_size,
        eos_ids[0] if eos_ids else None, max_model_len, bool(config.scheduler.decode_lookahead),
        extra_eos_token_ids=tuple(eos_ids[1:]),
        grammar_info=functools.partial(tokenizer_info, source.tokenizer.hf, model.vocab_size, sorted(set(eos_ids))),
    )
    runner.adapter_slots = adapter_slots
    if isinstance(member, TPDriver):
        runner.tp_driver = member
    if graphs:
        runner.capture_decode_graphs(config.scheduler.max_num_seqs, max_model_len)
    if compile_decode:
        use_persistent_cache(str(default_cache_dir().parent / "inductor"))
        runner.compile_decode(config.scheduler.max_num_seqs)
        compiled_dequant.enable()
        warm_up_prefill(runner, compiled_dequant.WARM_UP_TOKENS, num_blocks)
    if not is_driver:
        # A follower: rank 0's warm-up steps reach it through the step messages.
        return Worker(
            config=config, tokenizer=source.tokenizer, runner=runner, eos_token_id=None, extra_eos_token_ids=(),
            vocab_size=model.vocab_size, num_blocks=num_blocks,
        )  # fmt: skip
    if device.type == "cuda":
        warm_up_mixed_steps(runner, num_blocks, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        warm_up_adapter_kernels(runner, num_blocks, config.scheduler.max_num_seqs,
                                config.scheduler.max_num_batched_tokens)  # fmt: skip
    return Worker(
        config=config,
        tokenizer=source.tokenizer,
        runner=runner,
        eos_token_id=eos_ids[0] if eos_ids else None,
        extra_eos_token_ids=tuple(eos_ids[1:]),
        vocab_size=model.vocab_size,
        num_blocks=num_blocks,
        lora_spec=lora_model_spec(model) if adapter_slots is not None else None,
        adapters=adapter_slots.host if adapter_slots is not None else None,
        tp=member if isinstance(member, TPDriver) else None,
    )


def _attach_lora(
    model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device, member: TPRank | None
) -> AdapterSlots:
    """Device slots on every projection and the host cache that fills them (paphos/lora); with
    tensor parallelism each rank's hold its slice of every adapter, and rank 0 tells the others
    which adapters to load through the step messages."""
    lora = config.lora
    lora_dtype = dtype if lora.lora_dtype == "auto" else _DTYPES[lora.lora_dtype]
    host = AdapterHostCache(
        lora_model_spec(model), lora.max_lora_rank, lora_dtype, lora.cpu_capacity, pin_memory=device.type == "cuda",
        slices=rank_slices(model), announces=isinstance(member, TPDriver),
    )  # fmt: skip
    if isinstance(member, TPDriver):
        member.announced_adapters = host.take_announced
    return AdapterSlots(model, host, lora.max_loras, lora.max_lora_rank, lora_dtype, device)


def cpu_compile_enabled() -> bool:
    """`PAPHOS_CPU_COMPILE=0` turns the compiled CPU decode step off for every engine a process
    starts, spawned servers included (the test suite sets it: each of its many tiny models would
    otherwise be compiled; tests/worker/test_compiled_decode.py turns it back on)."""
    return os.environ.get("PAPHOS_CPU_COMPILE", "1") != "0"


def _attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    name = config.model.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchReferenceBackend()
    if device.type != "cuda":
        raise ConfigError(f"--attention-backend triton needs a CUDA GPU; the device is {device}")
    from paphos.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _kv_cache_dtype(config: EngineConfig, backend: AttentionBackend, dtype: torch.dtype) -> torch.dtype:
    name = config.cache.kv_cache_dtype
    if name == "auto":
        return dtype
    if name not in _FP8_KV_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {name} is not supported; use fp8 (e4m3) or auto")
    if backend.name != "triton":
        raise ConfigError(
            f"--kv-cache-dtype {name} needs the Triton attention backend (a CUDA GPU); "
            f"the {backend.name} backend stores K/V in the model dtype"
        )
    return _FP8_KV_DTYPES[name]


def _kv_budget_bytes(model: torch.nn.Module, config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    if config.cache.num_gpu_blocks_override is not None:
        return 0  # the override wins; no need to profile
    if device.type == "cuda":
        return profile_kv_budget(model, config, spec, device)
    return int(config.cache.cpu_kv_cache_gb * (1 << 30))
