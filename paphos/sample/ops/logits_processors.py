"""The fixed pre-chain (contract §4.1 step 1): additive logit bias and token masks."""

import torch


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))
