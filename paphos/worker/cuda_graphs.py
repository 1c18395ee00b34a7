"""CUDA graphs for decode-only steps: the model forward and the LM head replayed as one graph.

Data flow: model runner -> (a step whose every sequence decodes one token, on a GPU, without
--enforce-eager) -> DecodeGraphs.run(step inputs) -> logits of every row -> sampler (eager).
Mixed steps (any prefill chunk) run eagerly: their shapes vary every step and their time is
dominated by large GEMMs, where launch overhead does not matter.

One graph per batch bucket (1, 2, 4, 8, then every 8 up to 64, then every 16 up to
--max-num-seqs); a batch is padded to the next bucket. The graphs read their inputs from static
buffers this class owns; padding rows write their K/V into the reserved null block 0 and attend
one token of it, so they never touch a real sequence. All graphs share one memory pool, captured
largest first so smaller graphs reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from paphos.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max(max_num_seqs, 80) + 16, 16))
    buckets = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return buckets


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.block_size = block_size
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=batch,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            decode_only=True,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._metadata(batch))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for batch in reversed(self.buckets):
            # Warm up outside the graph (Triton compiles and autotunes, cuBLAS picks algorithms).
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batches %s in %.1f s", self.buckets, time.perf_counter() - start
        )

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and metadata.max_query_len == 1
            and metadata.num_tokens <= self.max_batch
            and metadata.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def bucket(self, num_rows: int) -> int:
        """The batch size of the graph a decode batch of `num_rows` replays (padded up)."""
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replays the smallest graph that holds this decode batch; returns logits [B, vocab]."""
        n = metadata.num_tokens
        batch = self.bucket(n)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if batch > n:
            # Padding rows: write into the null block, attend one token of it.
            self.slot_mapping[n:batch].zero_()
            self.seq_lens[n:batch].fill_(1)
            self.block_tables[n:batch, 0].zero_()
        return self._replay(n)

    def run_next(self, sampled_ids: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Replays the next decode step of the batch the last `run` or `run_next` replayed, with
        its sampled ids as input and no host data but the block tables (device tensor, already
        holding every row's next block): each row moves one position on, its slot looked up in
        its block table on the device."""
        n = sampled_ids.shape[0]
        self.input_ids[:n].copy_(sampled_ids)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        positions = self.positions[:n].add_(1)
        self.seq_lens[:n].add_(1)
        block_size = self.block_size
        blocks = self.block_tables[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        torch.add(positions % block_size, blocks.long(), alpha=block_size, out=self.slot_mapping[:n])
        return self._replay(n)

    def _replay(self, n: int) -> torch.Tensor:
        graph, logits = self.graphs[self.bucket(n)]
        graph.replay()
        return logits[:n]
