"""The engine core's own process: EngineCore in a busy loop that never waits on HTTP.

Data flow (design.md §2, rule 5): the API process (async_engine.py) binds two ZMQ sockets and
starts this process, which connects to them. In: msgpack-encoded `CoreInput` messages (new
requests, finishes, rollbacks). Out: one message per step, the step's `EngineCoreOutputs`. The
loop drains every waiting input, runs one step, sends its outputs and goes on; it blocks only
when no request is left. Each message out is two frames: a kind, then the body:

    READY   pickled `EngineInfo` (tokenizer included), once, after the model has loaded
    FAILED  a UTF-8 message, instead of READY, when loading failed
    OUTPUTS an `EngineCoreOutputs` (msgspec msgpack)
    DIED    a UTF-8 message, when the loop raised; the process then exits non-zero

`PAPHOS_STEP_TRACE=FILE` makes the loop append one JSON line per step to FILE: when the step
began, its duration, the inputs taken before it, the rows it sampled, the requests it scheduled
for the first time and the scheduler's queue lengths. It is how a load's step pattern is read
(which steps carried prefills, how arrivals spread over steps), at the cost of one line write.

Lifecycle: the process dies with its parent (PR_SET_PDEATHSIG on Linux, and a parent-pid check
while idle), ignores SIGINT (Ctrl-C reaches the whole process group; the API process decides
how to stop) and exits on SIGTERM. With `-tp N` it also dies (DIED, exit 1) when another rank
dies, checked every step and every idle second, and its ranks stop with it
(worker/tensor_parallel.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import sys
import time
from types import FrameType
from typing import IO, TYPE_CHECKING

import msgspec
import zmq

from paphos.config import EngineConfig
from paphos.core.protocol import CoreInput, EngineCoreOutputs

if TYPE_CHECKING:
    from paphos.engine.core import EngineCore

logger = logging.getLogger(__name__)

READY, FAILED, OUTPUTS, DIED = b"R", b"F", b"O", b"D"
_PR_SET_PDEATHSIG = 1
_IDLE_POLL_MS = 1000


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """The process's entry point (multiprocessing spawn target)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    core: EngineCore | None = None
    try:
        # Imported here: the API process imports this module for the entry point alone.
        from paphos.engine.core import EngineCore

        try:
            core = EngineCore(config)
        except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits non-zero
            logger.exception("loading the model failed")
            outputs.send_multipart([FAILED, str(exc).encode()])
            sys.exit(1)
        outputs.send_multipart([READY, pickle.dumps(core.info)])
        try:
            _busy_loop(core, inputs, outputs, parent_pid)
        except Exception as exc:  # noqa: BLE001 - the API process reports it and exits non-zero
            logger.exception("the engine core loop died")
            outputs.send_multipart([DIED, f"{type(exc).__name__}: {exc}".encode()])
            sys.exit(1)
    finally:
        if core is not None:
            core.close()  # tensor-parallel ranks stop with the core
        inputs.close(linger=0)
        outputs.close()
        context.term()


def _busy_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
    decoder = msgspec.msgpack.Decoder(CoreInput)
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    trace_path = os.environ.get("PAPHOS_STEP_TRACE")
    trace = open(trace_path, "a", buffering=1, encoding="utf-8") if trace_path else None  # noqa: SIM115
    while True:
        if not core.has_unfinished_requests():
            while not poller.poll(_IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.info("the API process is gone; the engine core stops")
                    return
                core.check_health()  # a dead tensor-parallel rank ends an idle core too
        handled = 0
        while True:
            try:
                frame = inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            core.handle(decoder.decode(frame.buffer))
            handled += 1
        if core.has_unfinished_requests():
            began = time.monotonic()
            step_outputs = core.step()
            if trace is not None:
                _trace_step(trace, began, handled, step_outputs)
            idle = not core.has_unfinished_requests()
            if step_outputs.req_ids or step_outputs.first_scheduled or step_outputs.rolled_back or idle:
                outputs.send_multipart([OUTPUTS, encoder.encode(step_outputs)], copy=False)
        elif handled:
            # The last requests were finished from outside (aborts): the API's gauges must see it.
            outputs.send_multipart([OUTPUTS, encoder.encode(core.idle_outputs())], copy=False)


def _trace_step(trace: IO[str], began: float, handled: int, outputs: EngineCoreOutputs) -> None:
    stats = outputs.stats
    trace.write(json.dumps({
        "t": round(began, 6), "ms": round((outputs.timestamp - began) * 1e3, 3), "inputs": handled,
        "sampled": len(outputs.req_ids), "new": len(outputs.first_scheduled),
        "running": stats.num_running if stats else None, "waiting": stats.num_waiting if stats else None,
    }) + "\n")


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies, even by SIGKILL (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the idle parent-pid check still applies
        pass


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
