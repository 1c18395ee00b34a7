"""EXL2 checkpoints (ExLlamaV2's converter): `quantization_config.quant_method == "exl2"`.

Data flow: registry.select -> `EXL2Config.from_quant_config(qc)` -> every decoder linear and the
`lm_head` get an `EXL2LinearMethod` -> the model's `load_weights` hands each checkpoint tensor to
the method's loader, which keeps it per shard -> `process_weights_after_loading` checks each
shard's tensors against each other (`check_tensors`) and then either
  - on CUDA with fp16 / bf16 activations: packs every shard into one set of planes for the Triton
    kernels (paphos/quant/kernels/exl2_layout.py: the checkpoint's codes re-laid in bit planes and
    its 4-bit scale codes as written, a per-run table of bit widths and groups, the permutation
    applied to x, one launch per merged layer; its docstring gives the layout and why), ->
    `triton_exl2.matmul` every step: a GEMV that decodes each weight once for up to
    GEMV_MAX_TOKENS tokens, above that dequantization into the shared scratch buffer + cuBLAS;
    start-up logs "Using EXL2 kernels for N layers". The first layer packed checks the kernels against its decoded weight once per
    device and dtype (`_self_check`); if they disagree or fail to compile, every layer takes the
    dense path below, with the reason logged;
  - elsewhere (the CPU, float32 models, a layout the kernels do not take: 1- or 7-bit groups, a
    group other than the last that is not whole 32-row runs): decodes each shard (`dequantize`)
    into one dense weight [N, K] in the model dtype -> `F.linear`; start-up logs the layers and
    the reason ("EXL2: N layers dequantized at load (...)").
Either way the checkpoint tensors are freed after loading.

The layout, per quantized linear (in K -> out N; the converter pads N to a multiple of 32):
  q_weight     int32 [R, N]    per output column a little-endian bit stream, group after group;
                               each run of 32 input rows of a `bits`-bit group takes `bits` words,
                               code v of the run at stream bits [v * bits, (v + 1) * bits), so
                               3/5/6/7-bit codes straddle word boundaries
  q_scale      int32 [G, N/8]  4-bit scale codes qs: nibble n % 8 of word n // 8
  q_scale_max  fp16  [G]
  q_groups     int16 [2G]      per group (bits, first q_weight row); the converter sorts groups by
                               descending bits, with 32, 64 or 128 rows each (the last takes the
                               rest); read as uint16
  q_invperm    int32 [K]       stored row q_invperm[k] holds input row k
  (bias        fp16  [N])      unpadded, loaded by the layer like any bias
w[n, k] = (code - 2**(bits - 1)) * s, s = fp16((qs + 1)**2 * fp16(q_scale_max[g] / 256)), with code
and g those of stored row q_invperm[k], column n. The two fp16 roundings of the scale are
exllamav2's, in its converter (which chose the codes against these scales: AdaptiveQuantizer
rounds them "for sanity") and in its kernels (make_q_matrix divides the fp16 q_scale_max by 256 in
place; dq_scale multiplies in fp16); a maximum below 2**-6 makes max / 256 an fp16 subnormal, so
the exact (qs + 1)**2 * max / 256 of quant-toolchain.md §5.3 can be ~1% off in 6- and 8-bit groups
of small weights. The weight is that scale times the code, rounded to fp16 once, as exllamav2's
reconstruction rounds it: on the tool-made fixtures (scripts/quant_fixtures/exllamav2_fixtures.py)
every decoded weight equals exllamav2's own reconstruction bit for bit.

Merged layers: q, k and v (gate and up) are quantized separately, each with its own groups,
permutation and number of q_weight rows, so they cannot sit side by side on the output axis of
one parameter as GPTQ's do; and every shape but q_invperm's depends on the bit allocation the
converter chose, so nothing can be allocated before the file is read. Each checkpoint tensor name
therefore gets a zero-size placeholder parameter (so `load_weights` finds a target for it and names
any that is missing); its loader keeps the loaded tensor in the method, keyed by (name, shard).
After loading, each shard is decoded on its own, cropped to its output rows and stacked (dense
path), or becomes one shard of the kernels' planes, which keep its own groups, scales and
permutation and put its columns after the previous shard's (one launch for the merged layer).

The head: exllamav2 writes a separately quantized `lm_head` (`head_bits`) even for models with
tied embeddings, and runs that head; `EXL2Config.unties_lm_head` tells the model to load it untied.

Tensor parallelism (`-tp N`, docs/tensor-parallel.md): each rank keeps its part of the checkpoint
tensors in their own layout, a valid EXL2 linear of its own, so both paths above run on it as is.
  - Column-parallel layers (q|k|v, gate|up; the head over its vocabulary rows): the rank's output
    columns of q_weight (a bit stream per column) and of q_scale's 4-bit codes (packed 8 per word
    again from the rank's first column, so a rank may start inside a word); q_scale_max, q_groups
    and q_invperm describe the input side and stay whole (`output_columns`).
  - Row-parallel layers (o_proj, down_proj) cannot take "input features [k0, k1)": the stored rows
    are permuted and grouped with mixed bit widths. A rank holds a contiguous range of stored rows
    instead, cut between runs of 32 (`split_stored_rows`: near-equal q_weight bytes per rank; a
    group cut in two keeps its bit width, scale row and maximum in both pieces), as a linear over
    those rows in stored order (`stored_rows`). Its x arrives split by features (the column-parallel
    layer before): `apply` all-gathers x over the group, picks the columns its stored rows multiply
    (argsort(q_invperm)[s0:s1]), and the layer's all-reduce sums the partial products. One extra
    all-gather of the activations per row-parallel layer, against re-packing every group's bit
    streams for a scattered set of input rows. Every rank needs a run: `EXL2Config.tp_split_problem`
    refuses a split that cannot be made before any rank starts.
The loader cuts as tensors arrive: a column-parallel rank's at once, a row-parallel rank's once the
layer's five are in (its cut depends on q_groups, q_weight and q_invperm, in whatever order the
files hold them), so whole tensors wait only until their layer is complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.parallel import Slice, TPGroup
from paphos.layers.weights import ShapeMismatchError
from paphos.quant.errors import QuantConfigError, field_value
from paphos.quant.int_linear import IntKernelLog
from paphos.quant.modules import checkpoint_modules

CHECKPOINT_TENSORS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
# The bit widths exllamav2's converter offers for the head (`-hb`); an fp16 head (16) predates
# `quantization_config` in config.json.
HEAD_BITS = (2, 3, 4, 5, 6, 8)
# The row-parallel layers (layers/linear.py RowParallelLinear), whose stored rows a
# tensor-parallel split cuts.
ROW_PARALLEL = (".o_proj", ".down_proj")
KERNELS = "exl2-kernels"
logger = logging.getLogger(__name__)


class EXL2FormatError(ValueError):
    """A layer's EXL2 tensors contradict each other; `tensor` names the one at fault."""

    def __init__(self, tensor: str, detail: str) -> None:
        super().__init__(f"EXL2 tensor {tensor}: {detail}")
        self.tensor = tensor
        self.detail = detail


@dataclass(frozen=True)
class Group:
    bits: int
    words: slice  # its rows of q_weight
    rows: slice  # its stored rows (input rows in q_invperm's order)


def parse_groups(q_groups: torch.Tensor, q_weight_rows: int, k: int) -> list[Group]:
    """The groups of a tensor with `k` input rows, checked against the q_weight rows they claim."""
    if q_groups.dim() != 1 or q_groups.numel() == 0 or q_groups.numel() % 2:
        raise EXL2FormatError("q_groups", f"shape {list(q_groups.shape)}: expected pairs (bits, first q_weight row)")
    pairs = (q_groups.to(torch.int64) & 0xFFFF).tolist()
    bits, starts = pairs[0::2], pairs[1::2]
    groups, row = [], 0
    for g, (b, w0, w1) in enumerate(zip(bits, starts, [*starts[1:], q_weight_rows], strict=True)):
        if not 1 <= b <= 8:
            raise EXL2FormatError("q_groups", f"group {g} has {b} bits (EXL2 codes have 1 to 8)")
        if (g == 0 and w0 != 0) or w1 <= w0:
            raise EXL2FormatError(
                "q_groups", f"group {g} starts at q_weight row {w0}, next at {w1} (of {q_weight_rows}): "
                "groups must start at row 0 and follow each other"
            )  # fmt: skip
        if g < len(bits) - 1:
            rows, whole = (w1 - w0) * 32 // b, (w1 - w0) * 32 % b == 0
        else:  # the last group takes the remaining input rows, its words rounded up
            rows = k - row
            whole = rows > 0 and w1 - w0 == -(-rows * b // 32)
        if not whole:
            raise EXL2FormatError(
                "q_groups", f"group {g} ({b} bits, q_weight rows {w0}..{w1}) does not fit {k} input rows"
            )
        groups.append(Group(b, slice(w0, w1), slice(row, row + rows)))
        row += rows
    return groups


def _unpack_group(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int64 words [W, N] (unsigned 32-bit values) -> codes [rows, N] of one group's bit streams."""
    n = words.shape[1]
    runs = F.pad(words, (0, 0, 0, -words.shape[0] % bits)).view(-1, bits, n)  # 32 codes per run
    start = torch.arange(32, device=words.device) * bits
    lo, shift = start // 32, (start % 32)[:, None]
    straddles = (shift + bits > 32).long()  # the code's high bits are in the next word
    hi = lo + straddles[:, 0]
    # a straddling code starts at bit 25 or later, so its high word moves left by at most 7 bits
    codes = (runs[:, lo] >> shift) | ((runs[:, hi] * straddles) << (32 - shift))
    return (codes & ((1 << bits) - 1)).reshape(-1, n)[:rows]


def check_tensors(
    q_weight: torch.Tensor,
    q_scale: torch.Tensor,
    q_scale_max: torch.Tensor,
    q_groups: torch.Tensor,
    q_invperm: torch.Tensor,
) -> list[Group]:
    """The groups of one EXL2 linear, its tensors checked against each other; EXL2FormatError
    names the tensor that does not fit."""
    k, n = q_invperm.numel(), q_weight.shape[1]
    groups = parse_groups(q_groups, q_weight.shape[0], k)
    if tuple(q_scale.shape) != (len(groups), -(-n // 8)):
        raise EXL2FormatError("q_scale", f"shape {list(q_scale.shape)}, expected {[len(groups), -(-n // 8)]}")
    if tuple(q_scale_max.shape) != (len(groups),):
        raise EXL2FormatError("q_scale_max", f"shape {list(q_scale_max.shape)}, expected {[len(groups)]}")
    invperm = q_invperm.long()
    if not torch.equal(invperm.sort().values, torch.arange(k, device=invperm.device)):
        raise EXL2FormatError("q_invperm", f"is not a permutation of 0..{k - 1}")
    return groups


def dequantize(
    q_weight: torch.Tensor,
    q_scale: torch.Tensor,
    q_scale_max: torch.Tensor,
    q_groups: torch.Tensor,
    q_invperm: torch.Tensor,
) -> torch.Tensor:
    """One EXL2 linear's weight, float32 [N, K] (N as stored, padding included), exactly by the
    module docstring's rule; EXL2FormatError names the tensor that does not fit."""
    k, n = q_invperm.numel(), q_weight.shape[1]
    groups = check_tensors(q_weight, q_scale, q_scale_max, q_groups, q_invperm)
    qs = _scale_codes(q_scale)[:, :n]
    # exllamav2's fp16 scale (module docstring); float32 holds it, and its products with codes, exactly
    smax = (q_scale_max.float() / 256).half().float()
    factor = ((qs + 1).square().float() * smax[:, None]).half().float()  # [G, N]
    words = q_weight.to(torch.int64) & 0xFFFFFFFF
    stored = torch.empty(n, k, dtype=torch.float32, device=q_weight.device)
    for g, group in enumerate(groups):
        codes = _unpack_group(words[group.words], group.bits, group.rows.stop - group.rows.start)
        # rounded to fp16 as exllamav2's reconstruction is (module docstring)
        stored[:, group.rows] = ((codes - (1 << (group.bits - 1))).float() * factor[g]).half().float().t()
    return stored[:, q_invperm.long()]


def _scale_codes(q_scale: torch.Tensor) -> torch.Tensor:
    """int32 [G, W] -> the 4-bit scale codes, int64 [G, 8 * W]: code n is nibble n % 8 of word n // 8."""
    nibbles = torch.arange(0, 32, 4, device=q_scale.device)
    return ((q_scale.to(torch.int64)[:, :, None] >> nibbles) & 15).flatten(1)


def output_columns(name: str, tensor: torch.Tensor, columns: Slice) -> torch.Tensor:
    """Checkpoint tensor `name` of a column-parallel rank holding output `columns` (q|k|v, gate|up:
    its heads or its share; the head: its vocabulary rows): its columns of q_weight (a bit stream
    per column) and of q_scale's codes, packed 8 per word again from the rank's first column (so
    a rank may start inside a word); the groups, their maxima and the permutation belong to the
    input side and stay whole."""
    if columns.is_whole or name not in ("q_weight", "q_scale"):
        return tensor
    if name == "q_weight":
        return tensor[:, columns.start : columns.start + columns.length]
    codes = _scale_codes(tensor)[:, columns.start : columns.start + columns.length]
    nibbles = torch.arange(0, 32, 4, device=codes.device)
    words = (F.pad(codes, (0, -columns.length % 8)).view(len(codes), -1, 8) << nibbles).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # unsigned words as int32


def run_bounds(groups: list[Group]) -> list[tuple[int, int]]:
    """(stored row, q_weight row) of each place a row-parallel rank's stored rows may begin or
    end: every run of 32 rows of every group (a run's codes fill its `bits` words and no others)
    and the end. A run is all the kernels need whole (groups are cut between runs: each rank's
    piece keeps the group's bit width, scale row and maximum)."""
    starts = [(row, g.words.start + (row - g.rows.start) // 32 * g.bits)
              for g in groups for row in range(g.rows.start, g.rows.stop, 32)]  # fmt: skip
    return [*starts, (groups[-1].rows.stop, groups[-1].words.stop)]


def split_stored_rows(groups: list[Group], ranks: int) -> list[tuple[int, int]]:
    """Each rank's stored rows [s0, s1) of a row-parallel layer: contiguous, cut between runs,
    each as near an equal share of q_weight's words (the bytes a decode step reads; bit widths
    differ between groups) as the runs allow. EXL2FormatError if there are fewer runs than ranks."""
    bounds = run_bounds(groups)
    runs, words = len(bounds) - 1, bounds[-1][1]
    if runs < ranks:
        raise EXL2FormatError(
            "q_groups", f"its {bounds[-1][0]} stored rows are {runs} run(s) of 32, fewer than the {ranks} "
            "tensor-parallel ranks (a row-parallel rank holds whole runs, at least one)"
        )  # fmt: skip
    cuts = [0]
    for rank in range(1, ranks):  # leaves at least one run to each later rank
        cuts.append(min(range(cuts[-1] + 1, runs - ranks + rank + 1), key=lambda i: abs(bounds[i][1] * ranks - words * rank)))
    cuts.append(runs)
    return [(bounds[a][0], bounds[b][0]) for a, b in zip(cuts, cuts[1:], strict=False)]


def stored_rows(
    tensors: dict[str, torch.Tensor], groups: list[Group], rows: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A row-parallel rank's part of one EXL2 linear: stored rows [s0, s1) (cut between runs,
    `split_stored_rows`) as an EXL2 linear of their own over s1 - s0 inputs taken in stored order
    (q_invperm the identity): its q_weight rows, a group per piece of the groups they cross, those
    groups' scale rows and maxima; and the input rows they multiply (argsort(q_invperm)[s0:s1]),
    the columns of the whole x the rank picks."""
    s0, s1 = rows
    word_of = dict(run_bounds(groups))
    crossed = [i for i, g in enumerate(groups) if g.rows.start < s1 and g.rows.stop > s0]
    # (bits, first q_weight row) per piece; int32, since the file's int16 is read as uint16
    pieces = [(groups[i].bits, word_of[max(groups[i].rows.start, s0)] - word_of[s0]) for i in crossed]
    first, last = crossed[0], crossed[-1] + 1
    part = {
        "q_weight": tensors["q_weight"][word_of[s0] : word_of[s1]],
        "q_scale": tensors["q_scale"][first:last],
        "q_scale_max": tensors["q_scale_max"][first:last],
        "q_groups": torch.tensor(pieces, dtype=torch.int32).flatten(),
        "q_invperm": torch.arange(s1 - s0, dtype=torch.int32),
    }
    return part, torch.argsort(tensors["q_invperm"].long())[s0:s1].to(torch.int32)


def _check_loaded(tensor: str, name: str, loaded: torch.Tensor, k: int, n: int) -> None:
    """What can be checked of one tensor alone: its dtype, and the shapes the layer fixes."""
    if name in ("q_weight", "q_scale") and loaded.dtype != torch.int32:
        raise EXL2FormatError(tensor, f"dtype {loaded.dtype}, expected torch.int32 (packed 32-bit words)")
    if name in ("q_groups", "q_invperm") and (loaded.is_floating_point() or loaded.is_complex()):
        raise EXL2FormatError(tensor, f"dtype {loaded.dtype}, expected an integer type")
    if name == "q_scale_max" and loaded.dtype != torch.float16:
        raise EXL2FormatError(tensor, f"dtype {loaded.dtype}, expected torch.float16 (its fp16 arithmetic is the format's)")
    if name == "q_invperm" and tuple(loaded.shape) != (k,):
        raise ShapeMismatchError((k,), tuple(loaded.shape))
    padded = n + (-n % 32)
    if name == "q_weight" and (loaded.dim() != 2 or loaded.shape[1] not in (n, padded)):
        raise ShapeMismatchError((loaded.shape[0], padded), tuple(loaded.shape))


class EXL2LinearMethod:
    """LinearMethod for one layer (or the head) of an EXL2 checkpoint (module docstring)."""

    def __init__(self, log: EXL2KernelLog, prefix: str) -> None:
        self.log = log
        self.prefix = prefix
        self.modules = checkpoint_modules(prefix)  # the checkpoint module of each shard
        self.tensors: dict[tuple[str, int], torch.Tensor] = {}
        # A row-parallel rank's checkpoint tensors as loaded, until all five are in (its stored
        # rows depend on q_groups, q_weight and q_invperm; the file's order is not fixed).
        self.whole: dict[str, torch.Tensor] = {}
        self.planes: Any = None  # exl2_layout.EXL2Planes once packed for the kernels
        self.inputs: torch.Tensor | None = None  # a row-parallel rank's columns of the whole x

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.output_sizes = tuple(getattr(layer, "output_sizes", None) or (output_size,))
        self.params_dtype = params_dtype
        # Tensor parallelism: each shard's output columns this rank holds (all of them unless
        # column-parallel), and its stored rows if row-parallel (module docstring).
        self.columns = [layer.tp_rows(shard) for shard in range(len(self.output_sizes))]
        rows = layer.tp_cols()
        self.input_size = rows.full  # the checkpoint's K, also for a row-parallel rank
        self.tp: TPGroup | None = layer.tp if not rows.is_whole else None
        # Outputs past the rank's columns: the last rank's padding rows of a vocabulary that does
        # not divide by the ranks (the head), zeros.
        self.padding = sum(self.output_sizes) - sum(c.length for c in self.columns)
        for name in CHECKPOINT_TENSORS:
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            placeholder.weight_loader = self._loader(layer, name)  # type: ignore[attr-defined]
            layer.register_parameter(name, placeholder)

    def _loader(self, layer: nn.Module, name: str) -> Callable[..., None]:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            shard = 0 if shard_id is None else layer.shard_index(shard_id)
            tensor = f"{self.modules[shard]}.{name}"
            _check_loaded(tensor, name, loaded, self.input_size, self.columns[shard].full)
            if self.tp is None:
                self.tensors[name, shard] = output_columns(name, loaded, self.columns[shard]).to(param.device, copy=True)
                return
            self.whole[name] = loaded
            if len(self.whole) == len(CHECKPOINT_TENSORS):
                part, inputs = self._rank_rows(self.whole)
                self.tensors |= {(n, 0): t.to(param.device, copy=True) for n, t in part.items()}
                self.inputs = inputs.to(param.device)
                self.whole.clear()

        return load

    def _rank_rows(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A row-parallel rank's stored rows of the layer (`stored_rows`), by the split the
        start-up check made (`split_stored_rows`)."""
        assert self.tp is not None
        try:
            groups = check_tensors(**tensors)
            rows = split_stored_rows(groups, self.tp.size)[self.tp.rank]
        except EXL2FormatError as e:
            raise EXL2FormatError(f"{self.modules[0]}.{e.tensor}", e.detail) from None
        return stored_rows(tensors, groups, rows)

    def _shard_tensors(self) -> list[dict[str, torch.Tensor]]:
        """Each shard's five checkpoint tensors (taken out of the method), checked against each
        other; the errors name the checkpoint tensor."""
        shards = []
        for shard, module in enumerate(self.modules):
            for name in CHECKPOINT_TENSORS:
                if (name, shard) not in self.tensors and name not in self.whole:
                    raise EXL2FormatError(f"{module}.{name}", "was not loaded (EXL2 layers need the checkpoint's tensors)")
            tensors = {name: self.tensors.pop((name, shard)) for name in CHECKPOINT_TENSORS}
            try:
                groups = check_tensors(**tensors)
            except EXL2FormatError as e:
                raise EXL2FormatError(f"{module}.{e.tensor}", e.detail) from None
            shards.append(tensors | {"groups": groups})
        return shards

    def _kernel_problem(self, shards: list[dict[str, Any]], device: torch.device) -> str | None:
        """Why this layer is dequantized at load rather than run by the EXL2 kernels, or None."""
        from paphos.quant.kernels import exl2_layout, triton_exl2

        if device.type != "cuda":
            return f"dequantized at load (no EXL2 kernel on {device.type})"
        if self.params_dtype not in (torch.float16, torch.bfloat16):
            return f"dequantized at load ({self.params_dtype} activations)"
        if not triton_exl2.supports(device, self.params_dtype):
            return "dequantized at load (the EXL2 kernels need Triton and a GPU of compute capability 8.0 or later)"
        k = shards[0]["q_invperm"].numel()  # the layer's inputs; a row-parallel rank's: its stored rows
        problem = exl2_layout.unsupported([_group_tuples(s["groups"]) for s in shards], k)
        return None if problem is None else f"dequantized at load ({problem})"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = self._shard_tensors()
        reason = self._kernel_problem(shards, shards[0]["q_weight"].device)
        if reason is None:
            from paphos.quant.kernels import exl2_layout, triton_exl2

            planes = exl2_layout.pack([
                exl2_layout.Shard(s["q_weight"], s["q_scale"], s["q_scale_max"], s["q_invperm"], _group_tuples(s["groups"]), c.length)
                for s, c in zip(shards, self.columns, strict=True)
            ])  # fmt: skip
            if _self_check(planes, lambda: self._dense(shards, torch.float32), self.params_dtype):
                for name, tensor in planes.tensors().items():  # buffers, so the model's memory accounts for them
                    layer.register_buffer(f"exl2_{name}", tensor, persistent=False)
                triton_exl2.reserve_scratch(planes, planes.words.device, self.params_dtype)
                # Held here too: the per-step path does no lookups.
                self.planes, self.matmul = planes, triton_exl2.matmul
                self.log.record(KERNELS, self.prefix)
            else:
                reason = "dequantized at load (the EXL2 kernels failed their start-up self-check on this GPU)"
        if reason is not None:
            dense = F.pad(self._dense(shards, self.params_dtype), (0, 0, 0, self.padding))
            layer.register_buffer("dense_weight", dense, persistent=False)
            self.log.record(reason, self.prefix)
        if self.inputs is not None:
            layer.register_buffer("exl2_inputs", self.inputs, persistent=False)
        for name in CHECKPOINT_TENSORS:
            delattr(layer, name)

    def _dense(self, shards: list[dict[str, Any]], dtype: torch.dtype) -> torch.Tensor:
        """The rank's weight [N, K], every shard decoded and cropped to its output columns (a
        row-parallel rank's K: its stored rows, in stored order)."""
        parts = [dequantize(*(s[name] for name in CHECKPOINT_TENSORS))[: c.length].to(dtype)
                 for s, c in zip(shards, self.columns, strict=True)]  # fmt: skip
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.inputs is not None:
            # A row-parallel rank: x arrives as its share of the features (from the column-parallel
            # layer before); its stored rows multiply features anywhere in x (module docstring).
            x = layer.tp.all_gather_last_dim(x).index_select(-1, self.inputs)
        if self.planes is None:
            return F.linear(x, layer.dense_weight, bias)
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        y = self.matmul(x2, self.planes)
        if self.padding:
            y = F.pad(y, (0, self.padding))
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y


_VERIFIED: dict[tuple[str, torch.dtype], bool] = {}


def _self_check(planes: Any, dense: Callable[[], torch.Tensor], dtype: torch.dtype) -> bool:
    """Once per (device, dtype) and process, on the first layer packed: the kernels (the GEMV at
    1 and 5 tokens, dequantize + cuBLAS at 16) against x @ the decoded weight. False (logged) if
    they fail to compile or disagree beyond 16-bit rounding; every EXL2 layer then dequantizes at
    load, so a kernel that misbehaves on a GPU costs speed, never wrong tokens."""
    from paphos.quant.kernels import triton_exl2

    key = (str(planes.words.device), dtype)
    if key not in _VERIFIED:
        ok = True
        try:
            w = dense()
            gen = torch.Generator(device=w.device).manual_seed(0)
            for m in (1, 5, 16):
                x = torch.randn(m, w.shape[1], device=w.device, generator=gen).to(dtype)
                ref = x.float() @ w.t()
                err = (triton_exl2.matmul(x, planes).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                if not err <= 1e-2:
                    logger.warning("EXL2 kernels: relative error %.3g at %d tokens against the decoded weight", err, m)
                    ok = False
        except Exception as e:  # noqa: BLE001 - any compile or launch failure -> the dense path
            logger.warning("EXL2 kernels failed their self-check (%s); dequantizing at load", e)
            ok = False
        _VERIFIED[key] = ok
    return _VERIFIED[key]


def _group_tuples(groups: list[Group]) -> list[tuple[int, int, int]]:
    return [(g.bits, g.words.start, g.rows.start) for g in groups]


class EXL2KernelLog(IntKernelLog):
    """Which path each EXL2 layer took: "Using EXL2 kernels for N layers", and every other
    outcome with its reason and an example layer."""

    def fast_path_line(self, outcome: str, count: int) -> str | None:
        return f"Using EXL2 kernels for {count} layers" if outcome == KERNELS else None


class EXL2Config:
    """The QuantConfig of an EXL2 checkpoint: every decoder linear and the head are quantized; bit
    widths and groups are per tensor (q_groups), so the config fixes nothing but the head."""

    name = "exl2"
    # exllamav2 writes and runs a quantized lm_head even for tied models: load it, untied.
    unties_lm_head = True

    def __init__(self, bits: float, head_bits: int) -> None:
        self.bits = bits  # the converter's target average, informational
        self.head_bits = head_bits
        self.log = EXL2KernelLog("EXL2")

    @classmethod
    def from_quant_config(cls, qc: dict[str, Any]) -> EXL2Config:
        bits = qc.get("bits")
        if isinstance(bits, bool) or not isinstance(bits, int | float):
            raise QuantConfigError(field_value("bits", bits, "the converter's bits per weight, a number"))
        head_bits = qc.get("head_bits", 6)
        if isinstance(head_bits, bool) or head_bits not in HEAD_BITS:
            raise QuantConfigError(field_value(
                "head_bits", head_bits, f"a quantized lm_head of {', '.join(map(str, HEAD_BITS))} bits, as exllamav2 writes it"
            ))  # fmt: skip
        return cls(float(bits), int(head_bits))

    def get_linear_method(self, prefix: str) -> EXL2LinearMethod:
        return EXL2LinearMethod(self.log, prefix)

    def tp_split_problem(self, files: list[Path], ranks: int) -> str | None:
        """Why the checkpoint in `files` cannot be split over `ranks` tensor-parallel ranks, or
        None: a row-parallel layer (o_proj, down_proj) with fewer runs of 32 stored rows than
        ranks (`split_stored_rows`; column-parallel layers split anywhere). Reads the q_groups of
        those layers and the shapes of their q_weight and q_invperm, before any rank starts."""
        from safetensors import safe_open

        q_groups: dict[str, torch.Tensor] = {}
        shapes: dict[tuple[str, str], list[int]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    module, _, tensor = name.rpartition(".")
                    if not module.endswith(ROW_PARALLEL):
                        continue
                    if tensor == "q_groups":
                        q_groups[module] = f.get_tensor(name)
                    elif tensor in ("q_weight", "q_invperm"):
                        shapes[module, tensor] = f.get_slice(name).get_shape()
        for module, groups in q_groups.items():
            if (module, "q_weight") not in shapes or (module, "q_invperm") not in shapes:
                continue  # loading names the missing tensor
            try:
                split_stored_rows(parse_groups(groups, shapes[module, "q_weight"][0], shapes[module, "q_invperm"][0]), ranks)
            except EXL2FormatError as e:
                return f"EXL2 tensor {module}.{e.tensor}: {e.detail}"
        return None

    def summary(self) -> list[str]:
        return self.log.summary()
