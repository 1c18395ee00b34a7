"""Token embedding (model input) and LM head (model output -> logits of the sampling rows).

Data flow: model runner input_ids -> VocabEmbedding -> decoder layers -> final norm -> [runner
picks the rows that sample] -> LMHead -> logits (fp32) -> sampler. With tied embeddings the head
shares the embedding's parameter, so the checkpoint's lm_head.weight (if any) is not loaded.

Quantized weights (a quant config's methods, e.g. GGUF blocks, paphos/quant/gguf/linear.py):
- the embedding's method (`embedding_method`) registers the parameter that holds the blocks and
  `embed(layer, ids)` dequantizes only the gathered rows;
- an untied head's method is a linear method over `lm_head.weight` (`create_weights` / `apply`);
- a head tied to a quantized embedding runs through the embedding's method (`use_as_head`), on the
  embedding's one copy of the blocks;
- a head tied to a float embedding may still take a method that keeps the float weight and only
  changes the computation (llama.cpp numerics, paphos/quant/gguf/llamacpp.py).
The model calls `process_weights_after_loading()` of both after loading. Logits are fp32 always.

Tensor parallelism (`-tp N`, layers/parallel.py): both are vocab-parallel. Rank r holds rows
[r * ceil(V / N), ...) of the table (the last rank's padded with zero rows); a lookup reads the
ids in the rank's rows, zeroes the others and one all-reduce sums the ranks' rows; the head
computes the logits of the rank's rows and gathers them to rank 0, which samples (the padding
columns at the end are cut by the model runner, as it cuts any padded vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers import parallel
from paphos.layers.parallel import Slice
from paphos.layers.weights import copy_checked, default_weight_loader


def _vocab_weight(rows: Slice, embedding_dim: int, dtype: torch.dtype, sharded: bool) -> nn.Parameter:
    """A float [padded rows, embedding_dim] weight whose loader copies this rank's vocabulary rows."""
    weight = nn.Parameter(torch.empty(rows.padded, embedding_dim, dtype=dtype), requires_grad=False)
    weight.weight_loader = _vocab_loader(rows) if sharded else default_weight_loader  # type: ignore[attr-defined]
    return weight


def _vocab_loader(rows: Slice) -> Any:
    """Loads this rank's rows of a [vocab, hidden] checkpoint table, zero rows after them. A
    quantized head's tensors hold the vocabulary on their `output_dim`, possibly packed (GPTQ's
    qzeros: 32 / bits rows per int32): their share of it, likewise."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter takes no shards, got shard {shard_id!r}")
        dim = getattr(param, "output_dim", 0)
        if loaded.dim() <= dim or loaded.shape[dim] * rows.padded != param.shape[dim] * rows.full:
            copy_checked(param.data, loaded)  # raises, naming both shapes
        part = rows.narrow(loaded, dim)
        copy_checked(param.data.narrow(dim, 0, part.shape[dim]), part)
        param.data.narrow(dim, part.shape[dim], param.shape[dim] - part.shape[dim]).zero_()

    return load


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        quant_method: Any | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp = parallel.current()
        self.sharded = self.tp.size > 1
        self.rows = self.tp.split_padded(num_embeddings)
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self, embedding_dim, self.rows.padded, params_dtype)
            return
        self.weight = _vocab_weight(self.rows, embedding_dim, params_dtype, self.sharded)

    def tp_rows(self, index: int) -> Slice:
        """The vocabulary rows this rank holds (a quant method that keeps its own layout reads it)."""
        return self.rows

    def tp_cols(self) -> Slice:
        return Slice.whole(self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            return self._sharded_lookup(input_ids)
        if self.quant_method is not None:
            return self.quant_method.embed(self, input_ids)
        return F.embedding(input_ids, self.weight)

    def _sharded_lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the ids this rank holds, zeros for the others, summed over the ranks."""
        start = self.rows.start
        mine = (input_ids >= start) & (input_ids < start + self.rows.length)
        local = torch.where(mine, input_ids - start, 0)
        if self.quant_method is not None:
            out = self.quant_method.embed(self, local)
        else:
            out = F.embedding(local, self.weight)
        return self.tp.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)


class LMHead(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tie_to: VocabEmbedding | None = None,
        quant_method: Any | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tie_to is not None
        # Vocab-parallel like the embedding (a tied head is the embedding's rows).
        self.tp = parallel.current()
        self.sharded = self.tp.size > 1
        self.rows = self.tp.split_padded(num_embeddings)
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method
        # (module whose parameters/buffers the method reads, method); a plain tuple, so a tied
        # embedding is not registered twice as a submodule.
        self._runs_on: tuple[nn.Module, Any] | None = None
        if tie_to is not None:
            self.weight = tie_to.weight
            if tie_to.quant_method is not None:
                tie_to.quant_method.use_as_head()
                self.quant_method = None  # the embedding loads and prepares the shared weight
                self._runs_on = (tie_to, tie_to.quant_method)
            elif quant_method is not None:
                self._runs_on = (self, quant_method)
        elif quant_method is not None:
            quant_method.create_weights(self, embedding_dim, self.rows.padded, params_dtype)
            self._runs_on = (self, quant_method)
        else:
            self.weight = _vocab_weight(self.rows, embedding_dim, params_dtype, self.sharded)

    def tp_rows(self, index: int) -> Slice:
        return self.rows

    def tp_cols(self) -> Slice:
        return Slice.whole(self.embedding_dim)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """For methods that create a float weight on the head (`UnquantizedLinearMethod`'s hook)."""
        if self.sharded:
            _vocab_loader(self.rows)(param, loaded)
            return
        copy_checked(param.data, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, vocab] in fp32 (the sampler works in fp32). With tensor
        parallelism: rank 0 gets [R, N * ceil(vocab / N)] (the columns past vocab are padding);
        the other ranks get their own part, which nothing reads."""
        if self._runs_on is not None:
            layer, method = self._runs_on
            logits = method.apply(layer, hidden).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        return self.tp.gather_last_dim(logits) if self.sharded else logits

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
