"""GPTQ checkpoints (AutoGPTQ / GPTQModel): `quantization_config.quant_method == "gptq"`.

Data flow: registry.select -> `GPTQConfig.from_quant_config(qc)` -> every decoder linear (and
`lm_head` when the checkpoint quantized it) gets an `IntLinearMethod` with `GPTQLayout`.

The layout, per linear (4-bit g128 shown; 8-bit packs 4 codes per word, 2-bit 16; 3-bit codes run
over word boundaries, 32 in every 3 words):
  qweight  int32 [K / 8, N]  8 codes per word along the input K: code j of word i is row 8i + j
  qzeros   int32 [G, N / 8]  zero points packed the same way along the output N
  scales   fp16  [G, N]      G = ceil(K / group_size) (the last group may be short)
  g_idx    int32 [K]         group of each input row: k // group_size, or a permutation's
                             groups with act-order (`desc_act`)
w[k, n] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]. The v1 format
(`checkpoint_format: "gptq"`) stores z - 1, modulo 2**bits (a zero of 0 is stored as 2**bits - 1);
v2 (`gptq_v2`) stores z. 2- and 3-bit codes and zeros are widened to 4 bits at load (both
shifted by 8 - 2**(bits-1): the same weights), so the 4-bit kernels run them; their planes take 2x
and 4/3 of the checkpoint's bytes.

Tensor parallelism (int_linear.py): a row-parallel rank takes its rows of qweight and g_idx and
every group's scales and zeros, keeping those its rows use after loading.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paphos.quant.errors import QuantConfigError, field_value
from paphos.quant.int_linear import (
    IntKernelLog,
    IntLinearMethod,
    IntQuantConfig,
    Unpacked,
    add_param,
    groups_of,
    num_shards,
    per_shard_loader,
    unpack_along_cols,
    unpack_along_rows,
)
from paphos.quant.modules import checkpoint_modules

logger = logging.getLogger(__name__)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GPTQLayout:
    bits: int
    group_size: int
    version: int  # 1: zeros stored minus one; 2: stored as they are
    act_order: bool = False  # desc_act: g_idx groups rows out of order
    int8_activations = False
    packed_along_output = ("qzeros",)
    packed_along_input = ("qweight",)

    @property
    def regroups_inputs(self) -> bool:
        return self.act_order

    def create_params(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        groups = groups_of(layer, self.group_size, replicated=True)
        add_param(layer, "qweight", (input_size * self.bits // 32, output_size), torch.int32, output_dim=1, input_dim=0)
        add_param(layer, "qzeros", (groups, output_size * self.bits // 32), torch.int32, output_dim=1, replicated=True)
        # float32 holds the file's fp16 scales exactly; the kernels take them in the model dtype
        add_param(layer, "scales", (groups, output_size), torch.float32, output_dim=1, replicated=True)
        add_param(layer, "g_idx", (num_shards(layer), input_size), torch.int32, None, per_shard_loader(layer, True))
        layer.g_idx.optional_in_checkpoint = True  # some AutoGPTQ files without act-order omit it
        # The checkpoint's groups of this rank's input rows (all of them without tensor parallelism).
        cols = layer.tp_cols()
        rows = torch.arange(cols.start, cols.start + input_size)
        layer.g_idx.data.copy_(rows // (self.group_size if self.group_size > 0 else cols.full))

    def unpack(self, layer: nn.Module) -> Unpacked:
        k, n = layer.qweight.shape[0] * 32 // self.bits, layer.qweight.shape[1]
        codes = unpack_along_rows(layer.qweight.data, self.bits)[:k].t()
        zeros = unpack_along_cols(layer.qzeros.data, self.bits)[:, :n]
        if self.version == 1:
            zeros = (zeros + 1) & ((1 << self.bits) - 1)
        zeros = zeros.t()
        bits = max(self.bits, 4)
        if bits != self.bits:  # widened: (q + c) - (z + c) is the same weight
            shift = (1 << (bits - 1)) - (1 << (self.bits - 1))
            codes, zeros = codes + shift, zeros + shift
        symmetric = bool((zeros == 1 << (bits - 1)).all())
        return Unpacked(
            codes=codes.contiguous(),
            scales=layer.scales.data.t().contiguous(),
            zeros=None if symmetric else zeros.to(torch.float32).contiguous(),
            groups=layer.g_idx.data.long(),
            shard_rows=tuple(getattr(layer, "output_sizes", (n,))),
            bits=bits,
        )


class GPTQConfig(IntQuantConfig):
    """The QuantConfig of a GPTQ checkpoint. GPTQModel's `dynamic` maps module-name regexes to
    overrides (`bits`, `group_size`; a "-:" prefix leaves the modules unquantized), e.g. an 8-bit
    group-32 `lm_head` in a 4-bit group-128 model; a merged layer's parts must agree."""

    name = "gptq"

    def __init__(
        self, layout: GPTQLayout, lm_head: bool, dynamic: tuple[tuple[str, bool, GPTQLayout | None], ...] = ()
    ) -> None:
        self.layout = layout
        self.lm_head = lm_head
        self.dynamic = dynamic  # (regex, negative, layout of a positive match)
        self.log = IntKernelLog("GPTQ")

    @classmethod
    def from_quant_config(cls, qc: dict[str, Any]) -> GPTQConfig:
        checkpoint_format = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if qc.get("is_marlin_format") or checkpoint_format not in CHECKPOINT_FORMATS:
            value = "marlin" if qc.get("is_marlin_format") else checkpoint_format
            raise QuantConfigError(field_value(
                "checkpoint_format", value, f"supported: {', '.join(CHECKPOINT_FORMATS)} (the files GPTQModel and AutoGPTQ write)"
            ))
        version = 2 if checkpoint_format == "gptq_v2" else 1
        layout = _layout(qc, version, "")
        dynamic = []
        for key, overrides in (qc.get("dynamic") or {}).items():
            negative = key.startswith("-:")
            pattern = key[2:] if key[:2] in ("-:", "+:") else key
            merged = None if negative else _layout({**qc, **overrides}, version, f"dynamic.{key}.")
            dynamic.append((pattern, negative, merged))
        for bits in sorted(({layout.bits} | {d.bits for _, _, d in dynamic if d is not None}) - {4, 8}):
            logger.info("GPTQ %d-bit codes are widened to 4 bits at load: the 4-bit kernels run them, and their "
                        "planes take %s of the checkpoint's bytes", bits, "2x" if bits == 2 else "4/3")  # fmt: skip
        return cls(layout, bool(qc.get("lm_head", False)), tuple(dynamic))

    def layout_of(self, module: str) -> GPTQLayout | None:
        for pattern, negative, layout in self.dynamic:
            if re.match(pattern, module):
                return None if negative else layout
        return self.layout

    def get_linear_method(self, prefix: str) -> IntLinearMethod | None:
        if prefix == "lm_head" and not self.lm_head:
            return None
        layouts = {self.layout_of(m) for m in checkpoint_modules(prefix)}
        if len(layouts) > 1:
            raise QuantConfigError(field_value(
                "dynamic", "...", f"the parts of {prefix} ({', '.join(checkpoint_modules(prefix))}) must be quantized alike"
            ))
        layout = layouts.pop()
        return None if layout is None else IntLinearMethod(layout, self.log, prefix)

    def summary(self) -> list[str]:
        return self.log.summary()


def _layout(qc: dict[str, Any], version: int, where: str) -> GPTQLayout:
    bits = qc.get("bits", 4)
    if bits not in (2, 3, 4, 8):
        raise QuantConfigError(field_value(f"{where}bits", bits, "2, 3, 4 or 8 bits are supported"))
    group_size = qc.get("group_size", 128)
    if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % 8)):
        raise QuantConfigError(field_value(f"{where}group_size", group_size, "a positive multiple of 8, or -1"))
    return GPTQLayout(bits, group_size, version, bool(qc.get("desc_act", False)))
