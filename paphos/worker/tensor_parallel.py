"""Tensor parallelism across processes (`-tp N`): rank 0 drives from the engine core, ranks
1..N-1 follow in processes of their own (docs/tensor-parallel.md).

Data flow of a step:

    EngineCore -> Scheduler.schedule() -> SchedulerOutput            (rank 0 only: one scheduler)
    rank 0 ModelRunner.execute -> TPDriver.run_step: one broadcast of StepMessage over a gloo group
        (the tokens rank 0 sampled last step + this step's SchedulerOutput, itself a diff)
    every rank: apply the diff -> build the flat batch -> forward (layers/parallel.py: an
        all-reduce after attention and after the MLP, the vocab-parallel embedding's all-reduce)
        -> the head's logits gathered to rank 0
    rank 0: sampler -> ModelRunnerOutput -> Scheduler.update_from_output()

Rank 0 samples, alone: one sampler keeps the per-request state that lives across steps (seeds'
random streams, mirostat mu, grammars, phrase-ban positions) and it is the only rank the scheduler
reads. The followers learn the sampled tokens from the next step's message; that costs nothing
extra, where every rank sampling its own copy would have to keep all that state in step.

Start-up: the engine core (worker/setup.py `load_worker`) checks that the model splits N ways
(`check_tensor_parallel`, before any process starts), starts the followers (multiprocessing
spawn, one per rank, each on device `cuda:rank`) and meets them in torch.distributed (NCCL for
the device tensors on CUDA, gloo on the CPU; a gloo group for the step messages either way).
Every rank then runs the same start-up (load its shards, profile, capture graphs), agrees on the
smallest KV block count, and the followers wait for step messages. Start-up work that goes
through `ModelRunner.execute` (kernel warm-up) is broadcast like any step.

Failure: a follower that dies ends the engine. `run_step` checks the followers before each step
and turns a collective that fails meanwhile (gloo notices a closed peer at once) into a
`TensorParallelError`; a watchdog thread exits the process if a step stays stuck in a collective
after a follower died (NCCL does not notice dead peers). Followers die with the engine core
(PR_SET_PDEATHSIG) and stop on its `close()`.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from paphos.config import ConfigError, EngineConfig
from paphos.core.protocol import LoRARequest
from paphos.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paphos.layers.parallel import Slice, TPGroup, qkv_rows
from paphos.models import hf_config as hf

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off in every process of the group.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Collectives of the forward pass: generous, since ranks meet there only once all have loaded
# (a barrier on the control group comes first), yet a rank that hangs ends the engine eventually.
_DEVICE_TIMEOUT = datetime.timedelta(minutes=30)
# The step messages: a follower waits for the next step as long as the engine is idle.
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)
# Bytes of the one broadcast a step message takes; a longer message takes a second broadcast.
_MESSAGE_BYTES = 16384
# How long a step may stay in a collective after a follower died before the process exits.
_HANG_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (the message names it); the engine cannot go on."""


class StepMessage(msgspec.Struct, frozen=True, array_like=True):
    """What rank 0 sends the followers before each step. `sampled`: the (request id, token) pairs
    rank 0 appended after the previous step; `scheduler_output`: this step's diff, None to stop;
    `adapters`: LoRA adapters rank 0 started loading since the last step (lora/host_cache.py), so
    the followers load their slices before a step needs them."""

    sampled: list[tuple[str, int]]
    scheduler_output: SchedulerOutput | None
    adapters: list[LoRARequest] = msgspec.field(default_factory=list)


def check_tensor_parallel(config: EngineConfig, source: Any, quant_config: Any, device: torch.device) -> None:
    """ConfigError unless the model, its weight format and the machine allow `-tp N`; run before
    any process starts, so a refusal is a plain start-up error naming the field at fault."""
    n = config.parallel.tensor_parallel_size
    if n == 1:
        return
    flag = f"--tensor-parallel-size {n}"
    text = getattr(source.hf_config, "text_config", None) or source.hf_config
    heads, kv_heads = text.num_attention_heads, hf.num_kv_heads(text)
    if heads % n:
        raise ConfigError(f"{flag} must divide the model's num_attention_heads ({heads})")
    if kv_heads % n and n % kv_heads:
        raise ConfigError(
            f"{flag}: the model's num_key_value_heads ({kv_heads}) must be a multiple or a divisor of {n}"
        )
    if text.intermediate_size % n:
        raise ConfigError(f"{flag} must divide the model's intermediate_size ({text.intermediate_size})")
    if config.model.gguf_numerics != "float":
        raise ConfigError(f"--gguf-numerics {config.model.gguf_numerics} is not supported with {flag} yet")
    if quant_config is not None:
        from paphos.quant.exl2 import EXL2Config
        from paphos.quant.fp8 import Fp8Config
        from paphos.quant.gguf import GGUFQuantConfig
        from paphos.quant.int_linear import IntQuantConfig

        if isinstance(quant_config, GGUFQuantConfig):
            _check_gguf_columns(quant_config, n)
        elif isinstance(quant_config, IntQuantConfig | Fp8Config):
            _check_layer_splits(quant_config, text, n)
        elif isinstance(quant_config, EXL2Config):
            _check_exl2_split(quant_config, source, n)
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + n > count:
            raise ConfigError(f"{flag} needs GPUs {first}..{first + n - 1}; {count} are visible")
    elif device.type != "cpu":
        raise ConfigError(f"{flag} runs on CUDA GPUs or the CPU, not on {device}")


def _check_gguf_columns(quant_config: Any, n: int) -> None:
    """A row-parallel GGUF weight (o_proj, down_proj) is split inside its rows: each rank's
    columns must be whole blocks of the tensor's type."""
    from gguf import GGML_QUANT_SIZES

    from paphos.quant.gguf.dequant import SUPPORTED_TYPES

    for name, tensor in quant_config.tensors.items():
        kept = tensor.tensor_type.name in SUPPORTED_TYPES and tensor.tensor_type.name != "F32"
        if not kept or not name.endswith((".o_proj.weight", ".down_proj.weight")):
            continue  # dequantized at load (a float layer splits anywhere) or split by whole rows
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        cols = tensor.shape[-1]
        if (cols // n) % block:
            raise ConfigError(
                f"--tensor-parallel-size {n}: GGUF tensor {name} ({tensor.tensor_type.name}, {cols} inputs) "
                f"would give each rank {cols // n} inputs, not a multiple of its block of {block} values"
            )


def _check_layer_splits(quant_config: Any, text: Any, n: int) -> None:
    """An integer-code checkpoint (GPTQ, AWQ, compressed-tensors) is split along its packed words
    and groups, an FP8 one with activations scaled per group along those groups: every rank's
    slice of every quantized layer must be whole ones (`tp_split_problem` of
    paphos/quant/int_linear.py and fp8.py)."""
    head_dim, heads = hf.head_dim(text), text.num_attention_heads
    inter, vocab = text.intermediate_size, text.vocab_size
    groups = [TPGroup(rank, n) for rank in range(n)]
    # (layer prefix, each rank's (output rows per checkpoint shard, input rows)), as layers/linear.py
    # and layers/embedding.py split them.
    kinds = {
        "self_attn.qkv_proj": [(qkv_rows(heads, hf.num_kv_heads(text), head_dim, tp), Slice.whole(text.hidden_size))
                               for tp in groups],
        "self_attn.o_proj": [([Slice.whole(text.hidden_size)], tp.split(heads * head_dim)) for tp in groups],
        "mlp.gate_up_proj": [([tp.split(inter)] * 2, Slice.whole(text.hidden_size)) for tp in groups],
        "mlp.down_proj": [([Slice.whole(text.hidden_size)], tp.split(inter)) for tp in groups],
    }  # fmt: skip
    layers = [(f"model.layers.{i}.{kind}", splits) for i in range(text.num_hidden_layers) for kind, splits in kinds.items()]
    layers.append(("lm_head", [([tp.split_padded(vocab)], Slice.whole(text.hidden_size)) for tp in groups]))
    for prefix, splits in layers:
        for rows, cols in splits:
            problem = quant_config.tp_split_problem(prefix, rows, cols)
            if problem is not None:
                raise ConfigError(f"--tensor-parallel-size {n}: {problem}")


def _check_exl2_split(quant_config: Any, source: Any, n: int) -> None:
    """An EXL2 o_proj / down_proj is split by runs of its stored rows (paphos/quant/exl2.py
    `split_stored_rows`): every rank needs one; the checkpoint's q_groups say how many there are."""
    from paphos.loader.safetensors_loader import safetensors_files

    problem = quant_config.tp_split_problem(safetensors_files(source.path), n)
    if problem is not None:
        raise ConfigError(f"--tensor-parallel-size {n}: {problem}")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: the GPU `rank` places after the first one; the CPU for all."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPRank:
    """One rank's membership: the group the layers' collectives use (`tp`) and the gloo group of
    the step messages and start-up agreements."""

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device) -> None:
        self.rank, self.size = rank, size
        # init_process_group prefixes every later traceback of the process with "[rankN]:"; rank 0
        # may be a user's own process (paphos.LLM), whose tracebacks stay as they were.
        excepthook = sys.excepthook
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl", store=store, rank=rank, world_size=size, timeout=_DEVICE_TIMEOUT, device_id=device
            )
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=_DEVICE_TIMEOUT)
        sys.excepthook = excepthook
        self.tp = TPGroup(rank, size, dist.group.WORLD)
        self.control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
        self._buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepMessage)

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. KV blocks: every rank holds as many)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def send(self, message: StepMessage) -> None:
        data = self._encoder.encode(message)
        head = self._buffer.numpy()
        head[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        fits = len(data) <= _MESSAGE_BYTES - 8
        if fits:
            head[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        dist.broadcast(self._buffer, group_src=0, group=self.control)
        if not fits:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), group_src=0, group=self.control)

    def receive(self) -> StepMessage:
        dist.broadcast(self._buffer, group_src=0, group=self.control)
        head = self._buffer.numpy()
        n = int(head[:8].view(np.int64)[0])
        if n <= _MESSAGE_BYTES - 8:
            return self._decoder.decode(head[8 : 8 + n].tobytes())
        data = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(data, group_src=0, group=self.control)
        return self._decoder.decode(data.numpy().tobytes())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TPDriver(TPRank):
    """Rank 0, inside the engine core: starts and supervises the followers and sends them each
    step (`run_step`, called by rank 0's ModelRunner.execute)."""

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> TPDriver:
        size = config.parallel.tensor_parallel_size
        os.environ.update(NVLS_OFF)  # inherited by the spawned followers; NCCL reads it at init
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
        spawn = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, size):
            process = spawn.Process(
                target=run_follower, args=(config, rank, store.port, os.getpid()),
                name=f"paphos-tp-rank-{rank}", daemon=True,
            )  # fmt: skip
            process.start()
            processes.append(process)
        logger.info("tensor parallel: %d ranks, followers %s", size, [p.pid for p in processes])
        try:
            _wait_for_followers(store, processes)
            driver = cls(0, size, store, device)
        except BaseException:
            _stop_processes(processes)
            raise
        driver._start_supervision(processes)
        return driver

    def _start_supervision(self, processes: list[multiprocessing.process.BaseProcess]) -> None:
        self.processes = processes
        self.failure: str | None = None
        self._sampled: list[tuple[str, int]] = []
        # Rank 0's host cache of LoRA adapters, when LoRA is on (worker/setup.py).
        self.announced_adapters: Callable[[], list[LoRARequest]] = list
        self._in_step = False
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._watchdog = threading.Thread(target=self._watch, name="paphos-tp-watchdog", daemon=True)
        self._watchdog.start()
        # Before multiprocessing's own exit handler (atexit runs last-registered first), which
        # would wait for followers that wait for a step.
        atexit.register(self.close)

    def dead_follower(self) -> str | None:
        """Why a follower is gone, or None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def await_dead_follower(self, timeout_s: float = 1.0) -> str | None:
        """`dead_follower`, waiting up to `timeout_s` for an exit status: after a collective broke,
        the follower's exit may trail its closed connection by a moment."""
        deadline = time.monotonic() + timeout_s
        dead = self.failure or self.dead_follower()
        while dead is None and time.monotonic() < deadline:
            time.sleep(0.01)
            dead = self.dead_follower()
        return dead

    def barrier(self) -> None:
        try:
            super().barrier()
        except RuntimeError as exc:
            self._raise_if_follower_died(exc)
            raise

    def agree_min(self, value: int) -> int:
        try:
            return super().agree_min(value)
        except RuntimeError as exc:
            self._raise_if_follower_died(exc)
            raise

    def _raise_if_follower_died(self, exc: BaseException) -> None:
        """A collective broke: a TensorParallelError naming the follower if one is gone (a
        follower that failed to load shows on rank 0 as a closed connection)."""
        dead = self.await_dead_follower()
        if dead is not None:
            self.failure = dead
            self.close()
            raise TensorParallelError(f"{dead} (its log says why)") from exc

    def check_alive(self) -> None:
        if self._closed:
            raise TensorParallelError(self.failure or "the tensor-parallel group was closed")
        dead = self.failure or self.dead_follower()
        if dead is not None:
            self.failure = dead
            self.close()
            raise TensorParallelError(dead)

    def note_sampled(self, req_ids: list[str], tokens: list[int]) -> None:
        """Tokens rank 0 appended to its request states; the followers append them next step."""
        self._sampled.extend(zip(req_ids, tokens, strict=True))

    def run_step(
        self, scheduler_output: SchedulerOutput, execute: Callable[[SchedulerOutput], ModelRunnerOutput]
    ) -> ModelRunnerOutput:
        """Sends the step to the followers, then runs rank 0's part (`execute`)."""
        self._in_step = True
        try:
            self.check_alive()
            message, self._sampled = StepMessage(self._sampled, scheduler_output, self.announced_adapters()), []
            self.send(message)
            return execute(scheduler_output)
        except TensorParallelError:
            raise
        except Exception as exc:
            self._raise_if_follower_died(exc)
            raise
        finally:
            self._in_step = False

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.processes] + [self._wake_r])
        if self._closed:
            return
        dead = self.await_dead_follower(0.2) or "a tensor-parallel follower exited"
        logger.error("%s; the engine stops", dead)
        self.failure = dead
        deadline = time.monotonic() + _HANG_GRACE_S
        while time.monotonic() < deadline:
            if self._closed or not self._in_step:
                return  # the step raised (or none was running: the next one raises)
            time.sleep(0.1)
        logger.critical("the engine is stuck in a collective with a dead rank (%s); exiting", dead)
        os._exit(1)

    def close(self) -> None:
        """Stops the followers (a stop message, then signals) and leaves the process group."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        if self.failure is None and self.dead_follower() is None:
            try:
                self.send(StepMessage([], None))
            except Exception:  # noqa: BLE001 - the followers are stopped by signal below
                logger.warning("tensor parallel: the stop message did not reach every follower")
        _stop_processes(self.processes)
        self.destroy()
        os.close(self._wake_r)
        os.close(self._wake_w)
        atexit.unregister(self.close)


def _wait_for_followers(store: dist.Store, processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Returns once every follower is about to join the process group; raises if one exits first
    (a rendezvous would otherwise wait for it until its timeout)."""
    keys = [f"follower-{rank}" for rank in range(1, len(processes) + 1)]
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if process.exitcode is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode} while starting (see its log)"
                )
        time.sleep(0.05)


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        process.join(10)
    for process in processes:
        if process.exitcode is None:
            process.terminate()
            process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join()


def run_follower(config: EngineConfig, rank: int, port: int, parent_pid: int) -> None:
    """A follower process (multiprocessing spawn target): joins the group, loads its shards, then
    runs each step rank 0 sends until told to stop. Exits non-zero on any failure."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; rank 0 decides
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    os.environ.update(NVLS_OFF)
    # Warnings and errors only: the start-up log lines are rank 0's to write.
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s"
    )
    # Imported here: setup.py imports this module.
    from paphos.worker.setup import load_worker, resolve_device

    member: TPRank | None = None
    try:
        size = config.parallel.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=_DEVICE_TIMEOUT)
        store.set(f"follower-{rank}", "1")
        member = TPRank(rank, size, store, rank_device(resolve_device(config.model.device), rank))
        runner = load_worker(config, member).runner
        while True:
            message = member.receive()
            if message.scheduler_output is None:
                break
            runner.follow(message.scheduler_output, message.sampled, message.adapters)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        if os.getppid() == parent_pid:  # rank 0 gone: its own error says why
            logger.exception("tensor-parallel rank %d failed", rank)
        sys.stdout.flush()
        os._exit(1)  # skip interpreter teardown: collectives of a broken group may block it
    finally:
        if member is not None:
            member.destroy()


def _die_with_parent() -> None:
    """SIGTERM when the engine core dies, even by SIGKILL (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
