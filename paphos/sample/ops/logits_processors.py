"""The fixed pre-chain (contract §4.1 step 1): allowed ids, the grammar mask, additive logit bias
and token masks (bans, min_tokens, this position's phrase bans)."""

import torch


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_allowed_ids(
    logits: torch.Tensor, rows: torch.Tensor, restricted_rows: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Rows in `restricted_rows` keep only the (row, token id) pairs listed; other rows are untouched."""
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[rows, token_ids] = True
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted[restricted_rows] = True
    return logits.masked_fill(restricted.unsqueeze(1) & ~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar mask: bit j of word w of bitmask[i] (int32 [n, ceil(V/32)]) allows token 32w + j in
    row rows[i]; the layout of xgrammar's token bitmask, unpacked with plain torch ops."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
