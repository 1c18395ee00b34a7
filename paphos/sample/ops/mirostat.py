"""Mirostat v1 and v2 (contract §4.4.10, llama.cpp / KoboldCpp semantics), as a selection stage.

`apply_mirostat` truncates each row with its own surprise target mu (mode 0 rows are untouched);
the sampler then draws from the renormalised result with the row's RNG, and `update_mu` moves mu
by eta * (surprise of the drawn token under that renormalised distribution - tau).
  v2: remove tokens whose surprise -log2 p exceeds mu (the argmax always stays).
  v1: estimate the Zipf exponent s from the top m = min(100, |F|) probabilities, then keep the
      top k = floor(((s - 1) 2^mu / (1 - N^-(s - 1)))^(1/s)) tokens, k clamped to [1, |F|].
"""

import math

import torch

from paphos.sample.ops.common import remove_keep_max

_ZIPF_WINDOW = 100


def _mirostat_v1_k(logits: torch.Tensor, mu: torch.Tensor, vocab_size: int) -> torch.Tensor:
    width = min(_ZIPF_WINDOW, logits.shape[1])
    top_logp = logits.log_softmax(dim=-1).topk(width, dim=-1).values
    num_finite = torch.isfinite(logits).sum(dim=-1)
    m = num_finite.clamp(max=width)
    i = torch.arange(width - 1, device=logits.device, dtype=torch.float32)
    t = torch.log((i + 2) / (i + 1)).unsqueeze(0)
    b = (top_logp[:, :-1] - top_logp[:, 1:]).nan_to_num(nan=0.0, posinf=0.0)
    valid = i.unsqueeze(0) < (m - 1).unsqueeze(1)
    s_hat = (t * b * valid).sum(dim=-1) / (t * t * valid).sum(dim=-1).clamp(min=1e-30)
    eps_hat = s_hat - 1
    k = ((eps_hat * torch.pow(2.0, mu)) / (1 - torch.pow(float(vocab_size), -eps_hat))).pow(1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(vocab_size)).floor()
    return torch.minimum(k.clamp(min=1), num_finite.float())


def apply_mirostat(logits: torch.Tensor, mode: torch.Tensor, mu: torch.Tensor, vocab_size: int) -> torch.Tensor:
    surprise = -logits.log_softmax(dim=-1) / math.log(2)
    remove_v2 = (surprise > mu.unsqueeze(1)) & (mode == 2).unsqueeze(1)
    k = _mirostat_v1_k(logits, mu, vocab_size)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k.long() - 1).clamp(min=0).unsqueeze(1))
    remove_v1 = (logits < kth) & (mode == 1).unsqueeze(1)
    return remove_keep_max(logits, remove_v1 | remove_v2)


def update_mu(
    truncated: torch.Tensor, sampled: torch.Tensor, mode: torch.Tensor, mu: torch.Tensor,
    tau: torch.Tensor, eta: torch.Tensor,
) -> torch.Tensor:
    logp = truncated.log_softmax(dim=-1).gather(1, sampled.unsqueeze(1)).squeeze(1)
    surprise = -logp / math.log(2)
    return torch.where(mode > 0, mu - eta * (surprise - tau), mu)
