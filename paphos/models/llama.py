"""Llama-family decoder (Llama 2/3, Mistral, SmolLM; Qwen2 and Qwen3 via `qwen2.py`, `qwen3.py`).

Data flow: model runner -> LlamaForCausalLM.forward(input_ids [T], positions [T], kv_caches,
AttentionMetadata) over one flat batch of decode rows and prefill chunks -> hidden [T, H];
the runner selects the rows that sample -> compute_logits -> sampler. Attention goes through the
injected `AttentionBackend`, which owns the paged cache layout; this file never indexes the cache.
With tensor parallelism (layers/parallel.py) each rank's attention runs its own heads (the counts
below are the rank's, read from `qkv_proj`) and o_proj / down_proj sum the ranks' outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from paphos.attention.backend import AttentionBackend
from paphos.attention.metadata import AttentionMetadata
from paphos.layers import parallel, x_int8, x_int8_outputs
from paphos.layers.activation import GeluTanhAndMul, SiluAndMul
from paphos.layers.embedding import LMHead, VocabEmbedding
from paphos.layers.linear import (
    LinearBase,
    LinearMethod,
    MergedColumnLinear,
    QKVLinear,
    QuantConfig,
    RowParallelLinear,
)
from paphos.layers.norm import RMSNorm
from paphos.layers.rotary import RotaryEmbedding
from paphos.layers.weights import ShapeMismatchError, default_weight_loader
from paphos.layers.x_int8_outputs import Int8Outputs
from paphos.models import hf_config
from paphos.models.errors import UnsupportedModelError, WeightLoadError
from paphos.quant import kv_cache as quant_kv


def _method(quant_config: QuantConfig | None, prefix: str) -> LinearMethod | None:
    return quant_config.get_linear_method(prefix) if quant_config is not None else None


def _embedding(config: Any, dtype: torch.dtype, quant_config: QuantConfig | None) -> VocabEmbedding:
    """`model.embed_tokens`, kept quantized when the quant config has an embedding method (GGUF)."""
    get = getattr(quant_config, "get_embedding_method", None)
    method = get("model.embed_tokens") if get is not None else None
    return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, method)


# A norm over each head of q and of k: a class built as `norm(head_dim, eps, dtype)`.
HeadNorm = Callable[[int, float, torch.dtype], nn.Module]


class LlamaAttention(nn.Module):
    """q/k/v projection -> (optional per-head q and k norms) -> backend (RoPE, K/V store, paged
    attention) -> o_proj. With `qk_norm` (Qwen3's RMSNorm, Gemma 3's (1 + w) one), each head of q
    and of k is normalised over head_dim before RoPE; the weights have head_dim entries, so under
    tensor parallelism every rank holds them whole. Where the quant config says the checkpoint
    carries FP8 KV-cache scales, `k_scale` / `v_scale` (per-tensor scalars, whole on every rank)
    are read once after loading into `kv_scales` and handed to the backend on every call
    (paphos/quant/kv_cache.py); an fp8 cache applies them, other caches ignore them."""

    def __init__(
        self,
        config: Any,
        sliding_window: int | None,
        dtype: torch.dtype,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        quant_config: QuantConfig | None,
        prefix: str,
        qk_norm: HeadNorm | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = hf_config.head_dim(config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend
        # One cos/sin table shared by all layers (registered in each; parameters/buffers dedupe).
        self.rotary_emb = rotary_emb
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, hf_config.num_kv_heads(config),
            qkv_bias, dtype, _method(quant_config, f"{prefix}.qkv_proj"),
        )  # fmt: skip
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            o_bias,
            dtype,
            _method(quant_config, f"{prefix}.o_proj"),
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype)
        # Set after loading (x_int8_outputs.feed): o_proj's int8 layouts, which the attention
        # backend's decode merge writes beside its output.
        self.int8_outputs: Int8Outputs | None = None
        # The checkpoint's (k_scale, v_scale) as Python floats, set after loading (None: none).
        self.kv_scales: tuple[float, float] | None = None
        if getattr(quant_config, "kv_cache_scales", False):
            quant_kv.add_scale_params(self)

    def process_weights_after_loading(self) -> None:
        self.kv_scales = quant_kv.read_scales(self)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.forward(
            q, k, v, kv_cache, md, self.scale, sliding_window=self.sliding_window, rotary=self.rotary_emb,
            positions=positions, int8_outputs=self.int8_outputs, kv_scales=self.kv_scales,
        )
        return self.o_proj(x_int8.reshape(out, t, self.num_heads * self.head_dim))


# Gated activations by HF config name (`hidden_activation`, else `hidden_act`).
_GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


class LlamaMLP(nn.Module):
    """down(act(gate) * up) with merged gate/up: Llama's SwiGLU, Gemma's GeGLU."""

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, quant_config: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _GATED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden activation {act!r} is not supported (supported: {', '.join(_GATED_ACTIVATIONS)})"
            )
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [inter, inter], bias, dtype, _method(quant_config, f"{prefix}.gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias, dtype, _method(quant_config, f"{prefix}.down_proj")
        )
        self.act = _GATED_ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        biases: tuple[bool, bool, bool],
        quant_config: QuantConfig | None,
        prefix: str,
        qk_norm: HeadNorm | None = None,
    ) -> None:
        super().__init__()
        qkv_bias, o_bias, mlp_bias = biases
        self.self_attn = LlamaAttention(
            config,
            hf_config.layer_sliding_window(config, layer_idx),
            dtype,
            backend,
            rotary_emb,
            qkv_bias,
            o_bias,
            quant_config,
            f"{prefix}.self_attn",
            qk_norm,
        )
        self.mlp = LlamaMLP(config, dtype, mlp_bias, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def feed_int8_inputs(self) -> None:
        """After loading: each norm, the attention and the activation also write the int8 parts
        of x the next projection's GEMV or int8 GEMM reads (x_int8_outputs.feed; nothing for
        layers that read none)."""
        x_int8_outputs.feed(self.input_layernorm, self.self_attn.qkv_proj)
        x_int8_outputs.feed(self.self_attn, self.self_attn.o_proj)
        x_int8_outputs.feed(self.post_attention_layernorm, self.mlp.gate_up_proj)
        x_int8_outputs.feed(self.mlp.act, self.mlp.down_proj)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous block is fused into this block's first norm.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        backend: AttentionBackend,
        biases: tuple[bool, bool, bool],
        quant_config: QuantConfig | None,
        qk_norm: HeadNorm | None = None,
    ) -> None:
        super().__init__()
        theta, scaling, partial = hf_config.rope_parameters(config)
        head_dim = hf_config.head_dim(config)
        rotary = RotaryEmbedding(
            head_dim, config.max_position_embeddings, theta, scaling, rotary_dim=int(head_dim * partial)
        )
        self.embed_tokens = _embedding(config, dtype, quant_config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, i, dtype, backend, rotary, biases, quant_config, f"model.layers.{i}", qk_norm
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# Checkpoint projections that live side by side in one merged parameter of ours:
# (checkpoint module name, our module name, shard id).
_STACKED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """The causal-LM shell shared by the Llama-shaped families: config bookkeeping, LM head (tied
    or not, optionally soft-capped), checkpoint loading. Families whose decoder differs (Gemma 3)
    override `build_model` and `layer_sliding_windows`."""

    # The HF default of `tie_word_embeddings` for the family, used when the config omits it.
    tie_word_embeddings_default = False

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        attn_backend: AttentionBackend,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        # Multimodal configs (Gemma 3) nest the decoder's settings.
        config = getattr(config, "text_config", None) or config
        self.config = config
        self.dtype = dtype
        self.num_layers: int = config.num_hidden_layers
        # This rank's KV heads: what the KV cache holds.
        self.num_kv_heads: int = parallel.kv_head_slice(hf_config.num_kv_heads(config), parallel.current()).length
        self.head_dim: int = hf_config.head_dim(config)
        self.vocab_size: int = config.vocab_size
        self.sliding_windows: list[int | None] = self.layer_sliding_windows(config)
        self.model = self.build_model(config, dtype, attn_backend, quant_config)
        self.final_soft_cap: float | None = getattr(config, "final_logit_softcapping", None)
        # A format may carry its own quantized head even for a tied model (EXL2): then it is untied.
        self.tie_word_embeddings = bool(
            getattr(config, "tie_word_embeddings", self.tie_word_embeddings_default)
        ) and not getattr(quant_config, "unties_lm_head", False)
        # The head's quant method: GGUF blocks of lm_head.weight (a head tied to a quantized
        # embedding runs through the embedding's method instead), or llama.cpp's input rounding
        # over the float weight; None = F.linear on a float weight.
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            quant_method=_method(quant_config, "lm_head"),
        )

    def build_model(
        self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend, quant_config: QuantConfig | None
    ) -> nn.Module:
        return LlamaModel(config, dtype, attn_backend, self.biases(config), quant_config)

    @staticmethod
    def layer_sliding_windows(config: Any) -> list[int | None]:
        return [hf_config.layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]

    @classmethod
    def biases(cls, config: Any) -> tuple[bool, bool, bool]:
        """(q/k/v bias, o_proj bias, MLP bias); subclasses for other families override."""
        attn = bool(getattr(config, "attention_bias", False))
        return attn, attn, bool(getattr(config, "mlp_bias", False))

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (num_blocks, 2, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] of the rows that sample -> fp32 logits [R, vocab], soft-capped if the
        config sets `final_logit_softcapping`."""
        logits = self.lm_head(hidden)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    # ---------------------------------------------------------------- weight loading

    def _checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors (name, shard id) that fill one of our parameters."""
        names = [
            (param_name.replace(ours, theirs), shard)
            for theirs, ours, shard in _STACKED
            if ours in param_name
        ]
        return names or [(param_name, None)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the model; raise WeightLoadError naming the tensor
        on an unknown name or a wrong shape, and listing every tensor still missing at the end."""
        arch = type(self).__name__
        params = dict(self.named_parameters())
        expected = {
            name
            for p, param in params.items()
            if not getattr(param, "optional_in_checkpoint", False)
            for name, _ in self._checkpoint_names(p)
        }
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue  # derived buffers some checkpoints carry (inv_freq, cos/sin caches)
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head is the embedding
            # Older names of the KV-cache scales (k_proj.output_scale) are not q/k/v shards.
            target, shard = quant_kv.checkpoint_name(name), None
            for theirs, ours, shard_id in _STACKED if target == name else ():
                if theirs in name:
                    target, shard = name.replace(theirs, ours), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise WeightLoadError.unknown(name, arch)
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            except ShapeMismatchError as e:
                raise WeightLoadError.shape_mismatch(name, e.expected, e.got) from None
            except WeightLoadError:
                raise
            except ValueError as e:  # a value the parameter cannot take (e.g. a scale of 0)
                raise WeightLoadError(f"checkpoint tensor {name!r}: {e}", name) from None
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise WeightLoadError.missing(missing, arch)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """Once every tensor is in: quant methods repack (or dequantize) their weights, and the
        decoder layers wire the int8 inputs of their GEMVs. Dummy weights call it directly."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.quant_method.process_weights_after_loading(module)
            elif isinstance(module, (VocabEmbedding, LMHead, LlamaAttention)):
                module.process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, LlamaDecoderLayer):
                module.feed_int8_inputs()
