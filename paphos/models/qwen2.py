"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (not on o_proj or the MLP), and
optional sliding-window layers that `hf_config.layer_sliding_window` reads from the config.
Data flow as in `llama.py`."""

from __future__ import annotations

from typing import Any

from paphos.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, config: Any) -> tuple[bool, bool, bool]:
        return True, False, False
