"""Token embedding (model input) and LM head (model output -> logits of the sampling rows).

Data flow: model runner input_ids -> VocabEmbedding -> decoder layers -> final norm -> [runner
picks the rows that sample] -> LMHead -> logits (fp32) -> sampler. With tied embeddings the head
shares the embedding's parameter, so the checkpoint's lm_head.weight (if any) is not loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.weights import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tie_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim, dtype=params_dtype or torch.get_default_dtype()),
                requires_grad=False,
            )
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, vocab] in fp32 (the sampler works in fp32)."""
        return F.linear(hidden, self.weight).float()
