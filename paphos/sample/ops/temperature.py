"""Temperature and dynamic temperature (contract §4.4.1): logits / T per row.

Dynatemp rows (min or max > 0) replace T by min + (max - min) * (H / ln|F|)^exponent, with H the
entropy of the current distribution and |F| its number of finite entries; T = min when |F| <= 1,
and never below 1e-5. Rows without dynatemp use their static T (1.0 is the identity).
"""

import torch

from paphos.sample.ops.common import entropy


def dynamic_temperature(
    logits: torch.Tensor, dyn_min: torch.Tensor, dyn_max: torch.Tensor, exponent: torch.Tensor
) -> torch.Tensor:
    num_finite = torch.isfinite(logits).sum(dim=-1).float()
    max_entropy = torch.log(num_finite.clamp(min=2.0))
    normalised = (entropy(logits) / max_entropy).clamp(0.0, 1.0)
    t = dyn_min + (dyn_max - dyn_min) * normalised.pow(exponent)
    t = torch.where(num_finite <= 1, dyn_min, t)
    return t.clamp(min=1e-5)


def apply_temperature(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    dyn_min: torch.Tensor | None = None,
    dyn_max: torch.Tensor | None = None,
    dyn_exponent: torch.Tensor | None = None,
) -> torch.Tensor:
    if dyn_min is not None and dyn_max is not None and dyn_exponent is not None:
        dynamic = (dyn_min > 0) | (dyn_max > 0)
        temperature = torch.where(dynamic, dynamic_temperature(logits, dyn_min, dyn_max, dyn_exponent), temperature)
    return logits.div_(temperature.unsqueeze(1))
