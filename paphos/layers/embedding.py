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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.weights import copy_checked, default_weight_loader


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
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self, embedding_dim, num_embeddings, params_dtype)
            return
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(self, input_ids)
        return F.embedding(input_ids, self.weight)

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
        self.tied = tie_to is not None
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
            quant_method.create_weights(self, embedding_dim, num_embeddings, params_dtype)
            self._runs_on = (self, quant_method)
        else:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim, dtype=params_dtype), requires_grad=False
            )
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """For methods that create a float weight on the head (`UnquantizedLinearMethod`'s hook)."""
        copy_checked(param.data, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, vocab] in fp32 (the sampler works in fp32)."""
        if self._runs_on is not None:
            layer, method = self._runs_on
            return method.apply(layer, hidden).float()
        return F.linear(hidden, self.weight).float()

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
