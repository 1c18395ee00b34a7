"""The linear method of integer-code checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized):
the checkpoint's own tensors in, the int kernel family (paphos/quant/kernels/int_layout.py,
triton_int.py) out.

Data flow: a format's QuantConfig gives each layer an `IntLinearMethod` with that format's
`IntLayout` -> `create_weights` registers the checkpoint tensors as parameters in the file's
layout (merged q|k|v and gate|up layers hold their shards side by side on the output axis;
per-shard tensors such as act-order `g_idx` get one row per shard) -> the model's `load_weights`
fills them -> `process_weights_after_loading` unpacks them to one common form (`Unpacked`: codes
[N, K], scales and zeros [N, G], each shard's input-row groups) and either
  - repacks them for the Triton kernels (CUDA, bf16/fp16): act-order groups are folded into a
    permutation of x so every group is contiguous (Marlin's idea),
  - packs 4-bit layers of a bf16 model on the CPU for torch's int4 matmul
    (paphos/quant/kernels/int4pack_cpu.py, groups of 32-256 dividing K; x permuted for act-order),
  - or dequantizes them once into a dense weight in the model dtype (float32 models, and layers
    no kernel takes, e.g. q/k/v shards with different act-order permutations),
and frees the checkpoint tensors. `IntKernelLog` counts the choice per layer so start-up logs it
in one line per outcome ("Using Marlin-class kernels for N layers", and every other path with its
reason).

Tensor parallelism (`-tp N`, docs/tensor-parallel.md): the layer's loader copies the rank's slice
of each checkpoint tensor before anything is unpacked, so each rank packs its own shard into the
same kernel layout. Column-parallel layers (q|k|v, gate|up, the vocabulary head) take whole output
columns (`output_dim`); row-parallel ones (o_proj, down_proj) a range of input rows (`input_dim`):
whole groups, whose scales and zeros slice with them. Layouts with a `g_idx` (GPTQ, act-order
compressed-tensors) instead keep every group's scales and zeros (`tp_replicated`) and take their
rows' g_idx entries; after loading, `keep_used_groups` keeps the groups the rank's rows use. Packed
words must not be cut and groups must be whole unless the layout regroups its rows (act-order):
`IntLinearMethod.tp_split_problem` says why a split fails; worker/tensor_parallel.py asks it before
any other rank starts.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.parallel import Slice, row_amax
from paphos.layers.weights import copy_checked
from paphos.layers.x_int8_blocks import BlockLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unpacked:
    """A layer's weight as integer codes: w[n, k] = (codes[n, k] - zero) * scale, where the group
    of input row k is `groups[s][k]` for the shard s that row n belongs to (None: k // group_size
    for every shard)."""

    codes: torch.Tensor  # [N, K] int, 0 <= code < 2**bits
    scales: torch.Tensor  # [N, G] float
    zeros: torch.Tensor | None  # [N, G] float; None: 2**(bits - 1) (symmetric)
    groups: torch.Tensor | None  # [S, K] int64 group of each input row, per shard; None: contiguous
    shard_rows: tuple[int, ...]  # output rows of each shard (sum N)
    bits: int  # the codes' width, the one the kernels take (a layout may widen its checkpoint's)


class IntLayout(Protocol):
    """One checkpoint format's tensors for a linear layer."""

    bits: int
    group_size: int  # -1: one group over the whole input (per output channel)
    int8_activations: bool  # round x to int8 per token before the matmul (W8A8 checkpoints)
    # Checkpoint tensors packing 32 / bits values per int32 along the output / the input axis:
    # a tensor-parallel rank's columns / rows of them must be whole words.
    packed_along_output: tuple[str, ...]
    packed_along_input: tuple[str, ...]
    # Input rows carry their group in a g_idx (act-order): any range of rows splits.
    regroups_inputs: bool

    def create_params(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        """Register the checkpoint's tensors on `layer` (see `add_param`)."""

    def unpack(self, layer: nn.Module) -> Unpacked: ...


class IntKernelLog:
    """Which path each layer took, logged once after loading (`summary`)."""

    def __init__(self, format_name: str) -> None:
        self.format_name = format_name
        self.outcomes: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def record(self, outcome: str, layer_name: str) -> None:
        self.outcomes[outcome] += 1
        self.examples.setdefault(outcome, layer_name)

    def fast_path_line(self, outcome: str, count: int) -> str | None:
        """The line users look for when `outcome` is the format's fast kernels, else None."""
        return f"Using Marlin-class kernels for {count} layers ({self.format_name})" if outcome == MARLIN_CLASS else None

    def summary(self) -> list[str]:
        """One line per outcome: the fast path's own line, or the layers' count, the reason and
        an example layer."""
        return [
            self.fast_path_line(outcome, count)
            or f"{self.format_name}: {count} layers {outcome} (e.g. {self.examples[outcome]})"
            for outcome, count in self.outcomes.items()
        ]


MARLIN_CLASS = "marlin-class"


def add_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    output_dim: int | None,
    loader: Callable[..., None] | None = None,
    input_dim: int | None = None,
    replicated: bool = False,
) -> None:
    """A checkpoint tensor as a parameter: sliced per shard on `output_dim` by the layer's own
    loader (merged layers), or filled by `loader`. A row-parallel layer's loader takes the
    rank's share of `input_dim`, or (`replicated`: a value per group of the whole input, or one
    for all of it) copies the tensor whole."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    if output_dim is not None:
        param.output_dim = output_dim  # type: ignore[attr-defined]
    if input_dim is not None:
        param.input_dim = input_dim  # type: ignore[attr-defined]
    param.tp_replicated = replicated  # type: ignore[attr-defined]
    param.weight_loader = loader or layer.weight_loader  # type: ignore[attr-defined]
    layer.register_parameter(name, param)


def per_shard_loader(layer: nn.Module, by_input: bool = False) -> Callable[..., None]:
    """Loader of a [shards, ...] parameter whose row s is shard s's own tensor (act-order g_idx:
    each of q, k and v has one over the same input). `by_input`: one entry per input row, of
    which a row-parallel layer keeps its own."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        row = 0 if shard_id is None else layer.shard_index(shard_id)
        cols = layer.tp_cols()
        if by_input and not cols.is_whole:
            loaded = cols.narrow(loaded, 0)
        copy_checked(param.data[row], loaded)

    return load


def groups_of(layer: nn.Module, group_size: int, replicated: bool) -> int:
    """Scale groups a layer's parameters hold along the input: those of its own input rows, or
    (`replicated`: a layout with g_idx) every group of the checkpoint's input."""
    k = layer.tp_cols().full if replicated else layer.tp_cols().length
    return 1 if group_size <= 0 else -(-k // group_size)


def keep_used_groups(u: Unpacked) -> Unpacked:
    """A row-parallel rank's weight whose scales and zeros hold every group of the checkpoint and
    whose `groups` are its input rows' checkpoint groups: only the groups used, renumbered in
    order (so rows that were contiguous groups stay contiguous groups)."""
    assert u.groups is not None
    used = torch.unique(u.groups)
    return replace(
        u,
        scales=u.scales[:, used].contiguous(),
        zeros=None if u.zeros is None else u.zeros[:, used].contiguous(),
        groups=torch.searchsorted(used, u.groups),
    )


def num_shards(layer: nn.Module) -> int:
    return len(getattr(layer, "output_sizes", ())) or 1


def packed_run(bits: int) -> tuple[int, int]:
    """(values, int32 words) of the shortest run of `bits`-bit values that fills whole words: 32 /
    bits values in one word where bits divides 32, 32 values in 3 words at 3 bits."""
    common = math.gcd(32, bits)
    return 32 // common, bits // common


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int64 [R * 32 / bits, C]: the values of each column as one little-endian
    bit stream down the rows, value v at bits v * bits of it; where bits divides 32, value j of
    word r is row r * (32 / bits) + j, at bits j * bits of the word, and 3-bit values (GPTQ's) run
    over word boundaries, 32 of them in every 3 words."""
    if 32 % bits:  # (the word-wise form below holds half the temporaries on a large layer's load)
        return _unpack_stream(packed, bits)
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_along_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int64 [R, C * 32 / bits]: each row's values as one bit stream along the
    columns (`unpack_along_rows`' rule), so where bits divides 32 value j of word c is column
    c * (32 / bits) + j (or + order[j]), at bits j * bits of the word."""
    if 32 % bits:
        assert order is None
        return _unpack_stream(packed.t(), bits).t()
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    values = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    if order is not None:
        values = values[:, :, torch.argsort(torch.tensor(order, device=packed.device))]
    return values.reshape(packed.shape[0], -1)


def _unpack_stream(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int64 [R * 32 // bits, C]: value v of a column from bits v * bits ..
    of its little-endian stream of R words, joined from two words where it straddles them."""
    words = F.pad(packed.to(torch.int64) & 0xFFFFFFFF, (0, 0, 0, 1))  # a zero word past the end
    start = torch.arange(packed.shape[0] * 32 // bits, device=packed.device) * bits
    word, shift = start // 32, (start % 32)[:, None]
    return (((words[word + 1] << 32) | words[word]) >> shift) & ((1 << bits) - 1)


def dequantize(u: Unpacked, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [N, K] in `dtype`, computed in float32 from the codes, shard by shard."""
    n, k = u.codes.shape
    zeros = u.zeros if u.zeros is not None else torch.full_like(u.scales, float(1 << (bits - 1)))
    contiguous = torch.arange(k, device=u.codes.device) // group_size
    parts, row = [], 0
    for shard, rows in enumerate(u.shard_rows):
        groups = contiguous if u.groups is None else u.groups[shard].long()
        sl = slice(row, row + rows)
        values = (u.codes[sl].float() - zeros[sl].float()[:, groups]) * u.scales[sl].float()[:, groups]
        parts.append(values.to(dtype))
        row += rows
    return torch.cat(parts)


def act_order_perm(u: Unpacked, group_size: int) -> tuple[torch.Tensor | None, str | None]:
    """The permutation of input rows that makes every group contiguous (None if they already
    are), or the reason there is none (as a second value)."""
    if u.groups is None:
        return None, None
    first = u.groups[0]
    if any(not torch.equal(first, g) for g in u.groups[1:]):
        return None, "have merged shards with different act-order permutations"
    k = first.numel()
    contiguous = torch.arange(k, device=first.device) // group_size
    if torch.equal(first.long(), contiguous):
        return None, None
    perm = torch.argsort(first.long(), stable=True)
    if not torch.equal(first.long()[perm], contiguous):
        return None, "have act-order groups of unequal sizes"
    return perm, None


def fake_quantize_int8(x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to symmetric int8 per token and back, as compressed-tensors computes dynamic W8A8
    activations: scale = max|x| / 127.5 (the int8 range 255 over 2), round half to even, clamp.
    `amax`: each token's max|x| [M, 1] over its whole row (a row-parallel rank's slice of x)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if amax is None else amax.reshape(*x.shape[:-1], 1)
    scale = amax / 127.5
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return (torch.round(xf / scale).clamp(-128, 127) * scale).to(x.dtype)


class IntLinearMethod:
    """LinearMethod for one layer of an integer-code checkpoint (module docstring). After loading
    the layer runs one of: the Triton kernels (`spec` set), torch's int4pack on a bf16 CPU
    (`int4pack_group` set), or the dense weight dequantized at load."""

    def __init__(self, layout: IntLayout, log: IntKernelLog, layer_name: str) -> None:
        self.layout = layout
        self.log = log
        self.layer_name = layer_name
        self.spec = None  # the Triton kernels' IntSpec once repacked for them
        self.int4pack_group: int | None = None  # the group size once packed for torch's CPU int4 matmul
        self.row_parallel = False

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype
        self.row_parallel = not layer.tp_cols().is_whole  # a rank holding some of the input rows
        self.layout.create_params(layer, input_size, output_size, params_dtype)

    def tp_split_problem(self, rows: list[Slice], cols: Slice) -> str | None:
        """Why a tensor-parallel rank cannot hold output rows `rows` (per checkpoint shard) and
        input rows `cols` of this layer's checkpoint tensors, or None (module docstring). The
        message names the tensor or the field."""
        per, words = packed_run(self.layout.bits)
        unit = "int32" if words == 1 else f"{words} int32s"
        for name in self.layout.packed_along_output:
            for s in rows:
                if not s.is_whole and (s.start % per or s.length % per or s.padded % per):
                    return (
                        f"{self.layer_name}.{name} packs {per} output columns per {unit}; a rank's columns "
                        f"[{s.start}, {s.start + s.length}) of {s.full} are not whole words"
                    )
        if cols.is_whole:
            return None
        for name in self.layout.packed_along_input:
            if cols.start % per or cols.length % per:
                return (
                    f"{self.layer_name}.{name} packs {per} input rows per {unit}; a rank's {cols.length} rows "
                    f"of {cols.full} are not whole words"
                )
        group = self.layout.group_size
        if group > 0 and not self.layout.regroups_inputs and (cols.start % group or cols.length % group):
            return (
                f"{self.layer_name}: quantization_config group_size {group}: a rank's {cols.length} input rows "
                f"of {cols.full} are not whole groups (each rank's share must be a multiple of {group})"
            )
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        u = self.layout.unpack(layer)
        if u.groups is not None and self.row_parallel:
            u = keep_used_groups(u)
        checkpoint_params = [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]
        group_size = self.layout.group_size if self.layout.group_size > 0 else u.codes.shape[1]
        perm, reason = act_order_perm(u, group_size)
        if reason is not None:
            reason = f"dequantized at load: they {reason}"
        elif u.codes.device.type == "cuda":
            reason = self._repack_for_triton(layer, u, group_size, perm)
        else:
            reason = self._repack_for_int4pack(layer, u, group_size, perm)
        if reason is not None:
            layer.register_buffer("dense_weight", dequantize(u, u.bits, group_size, self.params_dtype), persistent=False)
            self.log.record(reason, self.layer_name)
        for name in checkpoint_params:
            delattr(layer, name)

    def _repack_for_triton(self, layer: nn.Module, u: Unpacked, group_size: int, perm: torch.Tensor | None) -> str | None:
        """Repack for the Triton kernels; returns why not (the dense path) or None."""
        if self.params_dtype not in (torch.float16, torch.bfloat16):
            return f"dequantized at load ({self.params_dtype} activations)"
        from paphos.quant.kernels import int_layout, triton_int

        n, k = u.codes.shape
        spec = int_layout.IntSpec(
            bits=u.bits, group_size=group_size, in_features=k, out_features=n,
            has_zeros=u.zeros is not None, has_perm=perm is not None,
        )
        if not triton_int.supports(spec, u.codes.device, self.params_dtype):
            return f"dequantized at load (no kernel for {spec})"
        codes = u.codes if perm is None else u.codes[:, perm]
        zeros = None if u.zeros is None else u.zeros.to(self.params_dtype)
        planes = int_layout.pack(codes, u.scales.to(self.params_dtype), zeros, spec, perm)
        triton_int.reserve(spec, u.codes.device)
        for name, tensor in planes.items():  # buffers, so the model's memory accounts for them
            layer.register_buffer(f"int_{name}", tensor, persistent=False)
        # Held here too: the per-step path (eager prefill is host bound) does no lookups.
        self.planes, self.matmul = planes, triton_int.matmul
        self.spec = spec
        self.log.record(MARLIN_CLASS, self.layer_name)
        return None

    def _repack_for_int4pack(self, layer: nn.Module, u: Unpacked, group_size: int, perm: torch.Tensor | None) -> str | None:
        """Pack 4-bit layers of a bf16 model for torch's CPU int4 matmul; returns why not."""
        from paphos.quant.kernels import int4pack_cpu

        n, k = u.codes.shape
        if self.params_dtype != torch.bfloat16 or u.bits != 4 or not int4pack_cpu.supported(n, k, group_size):
            return "dequantized at load (no packed kernel for this layer on this device)"
        codes = u.codes if perm is None else u.codes[:, perm]
        zeros = u.zeros if u.zeros is not None else torch.full_like(u.scales, 8.0)
        scales = u.scales.float()
        # (q - z) * s = (q - 8) * s + (8 - z) * s
        packed, scale_zero = int4pack_cpu.pack(codes, scales, (8.0 - zeros.float()) * scales)
        layer.register_buffer("int4_packed", packed, persistent=False)
        layer.register_buffer("int4_scale_zero", scale_zero, persistent=False)
        if perm is not None:
            layer.register_buffer("int4_perm", perm, persistent=False)
        self.int4pack_group = group_size
        self.log.record("packed for torch's CPU int4 matmul", self.layer_name)
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.layout.int8_activations:
            # A row-parallel rank scales each token by its whole row, as -tp 1 does.
            x = fake_quantize_int8(x, row_amax(layer.tp, x) if self.row_parallel else None)
        if self.spec is None and self.int4pack_group is None:
            return F.linear(x, layer.dense_weight, bias)
        # x itself when it is 2-D: a view would drop the int8 parts its producer attached (x_int8)
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        if self.spec is not None:
            y = self.matmul(x2, self.planes, self.spec)
        else:
            from paphos.quant.kernels import int4pack_cpu

            if hasattr(layer, "int4_perm"):
                x2 = x2.index_select(1, layer.int4_perm)
            y = int4pack_cpu.matmul(x2, layer.int4_packed, layer.int4_scale_zero, self.int4pack_group)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y

    def int8_input_layout(self, layer: nn.Module) -> object | None:
        """The layout of int8 parts of x the batch-1 GEMV reads (x_int8_outputs.feed: the kernel producing
        x writes them), if any: not with act-order (x is gathered first) or int8 activations."""
        if self.spec is None or self.spec.has_perm or self.layout.int8_activations:
            return None
        from paphos.quant.kernels import triton_int

        return triton_int.int8_layout(self.spec)

    def int8_block_layout(self, layer: nn.Module) -> BlockLayout | None:
        """The layout of int8 parts of x the int8 tensor-core GEMM reads at a few tokens (x_int8_outputs.feed),
        if any; under the same conditions as `int8_input_layout`."""
        if self.int8_input_layout(layer) is None:
            return None
        from paphos.quant.kernels import triton_int

        return triton_int.int8_block_layout(self.spec)


class IntQuantConfig:
    """What the integer formats' QuantConfigs share: the start-up check of a tensor-parallel split
    (worker/tensor_parallel.py)."""

    def get_linear_method(self, prefix: str) -> IntLinearMethod | None:
        raise NotImplementedError

    def tp_split_problem(self, prefix: str, rows: list[Slice], cols: Slice) -> str | None:
        """Why the layer at `prefix` cannot be split this way (naming its tensor), or None."""
        method = self.get_linear_method(prefix)
        return method.tp_split_problem(rows, cols) if method is not None else None
