"""AWQ checkpoints in AutoAWQ's GEMM layout: `quantization_config.quant_method == "awq"`.

Data flow: registry.select -> `AWQConfig.from_quant_config(qc)` -> every decoder linear not in
`modules_to_not_convert` gets an `IntLinearMethod` with `AWQLayout`.

The layout, per linear (4-bit, group g):
  qweight  int32 [K, N / 8]  8 codes per word along the output N, interleaved: nibble j of
                             word c holds column 8c + AWQ_ORDER[j]
  qzeros   int32 [K / g, N / 8]  zero points, the same packing
  scales   fp16  [K / g, N]
w[k, n] = (q[k, n] - z[k // g, n]) * scales[k // g, n]. AWQ's activation smoothing is folded into
the checkpoint's RMSNorm weights, which load like any other tensor. The GEMV and GEMV-fast
layouts (`version: "gemv"`, `"gemv_fast"`) are other packings and are refused by name.

Tensor parallelism (int_linear.py): column-parallel ranks take whole packed words of output
columns (8 per int32, the interleaving stays inside a word); row-parallel ranks whole groups of
input rows, with their scales and zeros.
"""

from __future__ import annotations

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
    unpack_along_cols,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset held by nibble j of a word


@dataclass(frozen=True)
class AWQLayout:
    group_size: int
    bits: int = 4
    int8_activations = False
    packed_along_output = ("qweight", "qzeros")
    packed_along_input = ()
    regroups_inputs = False

    def create_params(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        groups = groups_of(layer, self.group_size, replicated=False)
        add_param(layer, "qweight", (input_size, output_size // 8), torch.int32, output_dim=1, input_dim=0)
        add_param(layer, "qzeros", (groups, output_size // 8), torch.int32, output_dim=1, input_dim=0)
        add_param(layer, "scales", (groups, output_size), torch.float32, output_dim=1, input_dim=0)

    def unpack(self, layer: nn.Module) -> Unpacked:
        n = layer.scales.shape[1]
        return Unpacked(
            codes=unpack_along_cols(layer.qweight.data, 4, AWQ_ORDER).t().contiguous(),
            scales=layer.scales.data.t().contiguous(),
            zeros=unpack_along_cols(layer.qzeros.data, 4, AWQ_ORDER).t().to(torch.float32).contiguous(),
            groups=None,
            shard_rows=tuple(getattr(layer, "output_sizes", (n,))),
            bits=4,
        )


class AWQConfig(IntQuantConfig):
    """The QuantConfig of an AutoAWQ GEMM checkpoint."""

    name = "awq"

    def __init__(self, group_size: int, skipped: tuple[str, ...]) -> None:
        self.layout = AWQLayout(group_size)
        self.skipped = skipped
        self.log = IntKernelLog("AWQ")

    @classmethod
    def from_quant_config(cls, qc: dict[str, Any]) -> AWQConfig:
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise QuantConfigError(field_value("bits", bits, "AWQ checkpoints are 4-bit"))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantConfigError(field_value("version", qc.get("version"), "only AutoAWQ's GEMM layout is supported"))
        if not qc.get("zero_point", True):
            raise QuantConfigError(field_value("zero_point", qc.get("zero_point"), "AWQ without zero points is not supported"))
        group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise QuantConfigError(field_value("group_size", group_size, "a positive multiple of 8"))
        return cls(group_size, tuple(qc.get("modules_to_not_convert") or ()))

    def get_linear_method(self, prefix: str) -> IntLinearMethod | None:
        if prefix == "lm_head" or any(name in prefix for name in self.skipped):
            return None
        return IntLinearMethod(self.layout, self.log, prefix)

    def summary(self) -> list[str]:
        return self.log.summary()
