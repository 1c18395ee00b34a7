"""Temperature: logits / T per row (contract §4.4.1)."""

import torch


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits.div_(temperature.unsqueeze(1))
