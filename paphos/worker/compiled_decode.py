"""Compiled decode steps on the CPU: the model forward and the LM head as inductor graphs.

Data flow: model runner -> (a step whose every sequence decodes one token, on the CPU, without
--enforce-eager) -> CompiledDecode.run(step inputs) -> logits of every row -> sampler (eager).
Prefill and mixed steps run eagerly: their time is in large GEMMs, not in dispatch.

Why: an eager decode step of a small model costs more in Python and per-op dispatch than in
arithmetic (SmolLM2-135M: ~2,000 aten calls per step for 30 layers). `torch.compile` with the CPU
inductor backend turns the step into a few fused C++ loops per layer around the packed matmuls,
the CPU counterpart of the CUDA graphs in cuda_graphs.py.

Two graphs per step, the layers and the LM head, each in two versions compiled at start-up
(`warm_up`): batch 1 (specialised; the single-stream step) and batch >= 2 (the batch size
symbolic). In both, the block-table width (the longest context of the step) is symbolic, padded
to at least 2 columns so that a one-block context never specialises it. The head is separate so
that inductor cannot inline the final norm into the head's loop over the vocabulary.

Numerics: inductor rounds every intermediate as eager does (`emulate_precision_casts`); what still
differs is summation order (the symbolic-batch graph's loops are tiled for any batch) and the
int8-group layers' batch-1 reduction, which sums in fp32 over the exact weights where eager rounds
them to bf16 (paphos/quant/kernels/int8_group_cpu.py): bf16 logits agree to their last bits,
float32 ones to ~1e-6 (tests/worker/test_compiled_decode.py: the same greedy tokens, logprobs
within 1e-4). Guards on module attributes are skipped (the weights never change after loading),
which takes the per-call guard check from ~1 ms to microseconds. A step whose inputs would need a
new graph runs eagerly instead of compiling in the middle of serving (logged once).

Compile time: about 100 s for the default model on 2 cores the first time; inductor's on-disk
cache (`TORCHINDUCTOR_CACHE_DIR`, by default under Paphos' cache directory) brings later starts
to about 20 s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from paphos.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MIN_BLOCK_COLUMNS = 2  # a symbolic dimension must not be 1 when a graph is traced


def use_persistent_cache(cache_dir: str) -> None:
    """Keeps inductor's compiled kernels in `cache_dir` (not /tmp) unless the user chose a place."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_num_seqs
        options = {
            "emulate_precision_casts": True,
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
        }
        # The LM head is a graph of its own: in one graph with the layers, inductor inlines the
        # final norm into the head's loop over the vocabulary (an int8 head: 1.7 -> 4.3 ms).
        self._layers = torch.compile(self._hidden, dynamic=False, options=options)
        self._head = torch.compile(model.compute_logits, dynamic=False, options=options)
        self._failed_once = False

    def _compiled(self, *args: torch.Tensor) -> torch.Tensor:
        return self._head(self._layers(*args))

    def _hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        batch = input_ids.shape[0]
        md = AttentionMetadata(
            num_tokens=batch,
            query_start_loc=seq_lens,  # unread on the decode-only path
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=1,
            max_seq_len=0,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            decode_only=True,
        )
        return self.model(input_ids, positions, self.kv_caches, md)

    def _forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self._hidden(*args))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles both graphs on padding inputs (they write into and read the null block 0)."""
        start = time.perf_counter()
        logger.info("compiling the CPU decode step: minutes on a first start, seconds once cached "
                    "(%s); --enforce-eager skips it", os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's cache"))  # fmt: skip
        for batch in (1, 2):
            args = self._inputs(
                torch.zeros(batch, dtype=torch.long),
                torch.zeros(batch, dtype=torch.long),
                torch.zeros(batch, dtype=torch.long),
                torch.zeros(batch, MIN_BLOCK_COLUMNS, dtype=torch.int32),
                torch.ones(batch, dtype=torch.int32),
            )
            if batch > 1:
                for t in args:
                    torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(args[3], 1)
            hidden = self._layers(*args)
            if batch > 1:
                torch._dynamo.mark_dynamic(hidden, 0)
            self._head(hidden)
        logger.info("compiled the CPU decode step (batch 1 and 2-%d) in %.1f s", self.max_batch,
                    time.perf_counter() - start)  # fmt: skip

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.max_query_len == 1 and metadata.num_tokens <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only batch."""
        args = self._inputs(input_ids, positions, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens)
        return self._graph_or_eager(self._compiled, self._forward, *args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's graphs on the sampling rows of any step (a prefill step's too: an int8 head
        dequantized per call eagerly costs ~35 ms on the default model, its graph 1.4 ms)."""
        return self._graph_or_eager(self._head, self.model.compute_logits, hidden)

    def _graph_or_eager(
        self, graph: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor], *args: torch.Tensor
    ) -> torch.Tensor:
        """graph(*args) if the compiled graphs take these inputs as they are, else eager(*args)
        (never a compile in the middle of serving; the first fallback is logged)."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return graph(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiled path falls back to eager
            if not self._failed_once:
                logger.warning("compiled CPU graph not used for a batch of %d (%s): running it eagerly",
                               args[0].shape[0], str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
                self._failed_once = True
            return eager(*args)

    @staticmethod
    def _inputs(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """The dtypes and shapes the graphs were traced with (another dtype would be a new graph)."""
        missing = MIN_BLOCK_COLUMNS - block_tables.shape[1]
        if missing > 0:
            block_tables = F.pad(block_tables, (0, missing))
        return (
            input_ids.long(),
            positions.long(),
            slot_mapping.long(),
            block_tables.to(torch.int32),
            seq_lens.to(torch.int32),
        )
