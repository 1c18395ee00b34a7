"""EngineInfo: what the API side needs to know of the loaded engine.

The engine core builds it once the model has loaded (core.py) and sends it to the API process
with its readiness (core_process.py); it holds no device state, so the API process needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from paphos.config import EngineConfig
from paphos.lora.spec import LoRAModelSpec
from paphos.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    """What the API side needs to know of the loaded engine (sent once, when the core is ready)."""

    config: EngineConfig  # with the model-derived values filled in (max_model_len, lookahead)
    tokenizer: Tokenizer
    vocab_size: int
    num_blocks: int
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    # The projections adapters may target, when LoRA is enabled (registration validates against it).
    lora_spec: LoRAModelSpec | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def stop_token_ids(self) -> list[int]:
        """Every id that ends generation (guided decoding's terminators)."""
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return sorted({*self.extra_eos_token_ids, *eos})
