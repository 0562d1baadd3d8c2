"""The decoder-only transformer of the Llama family (Llama, Qwen2, Qwen3, Mistral, and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE and Mixtral, whose sparse MLP is engine/model/moe.py's), DeepSeek-V2/V3 (latent attention,
engine/model/mla.py, and a group-routed MoE), Gemma 3 (its layer: engine/model/gemma.py) and gpt-oss (attention
sinks, clamped-SwiGLU experts) over a flat batch and a paged cache.

Every op follows transformers' modeling files in order and dtype (see PARITY.md), so greedy tokens match theirs.
q/k/v and gate/up projections are fused into one matmul each: fewer kernel launches, the same dot products. The
elementwise ops and attention run through `ops` (engine/model/kernels.py): C++ CPU kernels, or their torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention_with_sinks
from engine.config import ModelSpec, load_spec, run_dtype
from engine.model.kernels import REFERENCE, TorchOps, apply_rope, select_ops, split_heads
from engine.model.linear import Linear, can_pack
from engine.model.gemma import GemmaDecoderLayer, GemmaRMSNorm
from engine.model.mla import MlaAttention
from engine.model.moe import ClampedSwigluExperts, SparseMoe
from engine.model.norm import RMSNorm
from engine.kv.kv_cache import KVCache, KVLayout
from engine.parallel.shard import SINGLE, Shard, check_shardable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Attention(nn.Module):
    """This rank's heads (all of them on one rank); o_proj's output is this rank's part of the sum."""

    def __init__(self, spec: ModelSpec, layer_idx: int, ops: TorchOps, shard: Shard):
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads // shard.size, shard.num_kv_heads(spec)
        self.head_dim = spec.head_dim
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        # Qwen3 and Gemma 3 norm each head of q and k before RoPE.
        self.q_norm = _norm(spec, spec.head_dim, ops) if spec.qk_norm else None
        self.k_norm = _norm(spec, spec.head_dim, ops) if spec.qk_norm else None
        self.window = spec.sliding_windows[layer_idx]
        self.scale = (spec.gemma.query_pre_attn_scalar if spec.gemma else spec.head_dim) ** -0.5
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.attention_sinks else None  # gpt-oss
        self.ops = ops

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (heads + 2 kv_heads) * head_dim)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            q, k, v = self.ops.rope(qkv, cos, sin, *heads)  # (T, heads | kv_heads | kv_heads, head_dim)
        else:
            q, k, v = split_heads(qkv, *heads)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if self.sinks is None:
            out = self.ops.paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)  # (T, heads, hd)
        else:
            out = paged_attention_with_sinks(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """This rank's slice of the intermediate width; down_proj's output is this rank's part of the sum."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, shard: Shard):
        super().__init__()
        width = spec.intermediate_size // shard.size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * width, bias=spec.mlp_bias)
        self.down_proj = Linear(width, spec.hidden_size, bias=spec.mlp_bias)
        self.act_and_mul = ops.gelu_tanh_and_mul if spec.gemma else ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, ops: TorchOps, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.self_attn = MlaAttention(spec, ops, shard) if spec.mla else Attention(spec, layer_idx, ops, shard)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        sparse = spec.moe is not None and spec.moe.sparse_layers[layer_idx]
        self.mlp = SparseMoe(spec, ops, shard) if sparse else MLP(spec, ops, shard)
        self.shard = shard

    def forward(self, x, cos, sin, meta, *cache) -> torch.Tensor:
        """cache: this layer's views of the pool (keys and values, or MLA's latents)."""
        attn = self.shard.reduce(self.self_attn(self.input_layernorm(x), cos, sin, meta, *cache))
        x, h = self.post_attention_layernorm.add_norm(x, attn)  # x + attn, and its norm
        return x + self.shard.reduce(self.mlp(h))


def _norm(spec: ModelSpec, dim: int, ops: TorchOps) -> nn.Module:
    return GemmaRMSNorm(dim, spec.rms_norm_eps) if spec.gemma else RMSNorm(dim, spec.rms_norm_eps, ops)


def _decoder_layer(spec: ModelSpec, i: int, ops: TorchOps, shard: Shard) -> nn.Module:
    if spec.gemma:
        return GemmaDecoderLayer(spec, Attention(spec, i, ops, shard), MLP(spec, ops, shard), shard)
    return DecoderLayer(spec, i, ops, shard)


class CausalLM(nn.Module):
    """Construct with from_pretrained; the caller runs forward under torch.inference_mode.

    ops: how the fused ops run: the C++ CPU kernels where they build, else (and on other devices) torch.
    shard: the tensor-parallel rank this model is (engine/parallel/shard.py); every rank runs forward together."""

    def __init__(self, spec: ModelSpec, ops: TorchOps = REFERENCE, shard: Shard = SINGLE):
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.shard = shard
        self.vocab = shard.split(spec.vocab_size)  # the rows of the embedding table and LM head this rank holds
        self.embed_tokens = nn.Embedding(self.vocab.stop - self.vocab.start, spec.hidden_size)
        self.layers = nn.ModuleList(_decoder_layer(spec, i, ops, shard) for i in range(spec.num_layers))
        self.norm = _norm(spec, spec.hidden_size, ops)
        self.lm_head = Linear(spec.hidden_size, self.vocab.stop - self.vocab.start, bias=False)

    @classmethod
    def from_pretrained(cls, model_dir, dtype: str | None = None, device="cpu", ops: TorchOps | None = None,
                        pack: bool = True, shard: Shard = SINGLE, batch_invariant: bool = False) -> CausalLM:
        """ops: None picks the fastest that runs here (select_ops); pack: repack linear weights for oneDNN where
        this CPU runs the dtype there (Linear.pack); shard: load only this rank's part of the weights;
        batch_invariant: every query attends through the per-query kernel (select_ops; refused where a layer
        attends otherwise: latent attention, sinks)."""
        from engine.model.loader import load_weights  # the loader names this module's parameters

        spec = load_spec(model_dir)
        dtype = run_dtype(dtype, spec.checkpoint_dtype, device)
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        if batch_invariant and (spec.mla or spec.attention_sinks):
            raise ValueError(f"batch_invariant: {spec.architecture}'s attention (latent or with sinks) runs through "
                             "torch, whose kernels are not per-query invariant")
        ops = ops or select_ops(DTYPES[dtype], device, batch_invariant)
        check_shardable(spec, shard.size)
        with torch.device("meta"):  # no memory and no random init for weights about to be overwritten
            model = cls(spec, ops, shard)
        model = model.to(DTYPES[dtype]).to_empty(device=device)
        for module in model.modules():
            if isinstance(module, SparseMoe):
                module.keep_router_float32()
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model._init_rope(device)
        load_weights(model, model_dir)
        if shard.rank:
            model._zero_row_parallel_biases()
        if pack and can_pack(model.dtype, device):
            model._pack_linears(Linear.pack)
        elif pack and model.dtype != torch.float32 and can_pack(torch.float32, device):
            model._pack_linears(Linear.widen)
        return model.eval()

    def _pack_linears(self, how) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                # A tied lm_head's weight is the embedding table, which token lookups still need.
                how(module, free_weight=module.weight is not self.embed_tokens.weight)

    def _zero_row_parallel_biases(self) -> None:
        """A row-parallel projection's bias is added once to the sum: by rank 0 alone."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (Attention, MlaAttention, MLP)):
                    proj = module.down_proj if isinstance(module, MLP) else module.o_proj
                    if proj.bias is not None:
                        proj.bias.zero_()
                if isinstance(module, ClampedSwigluExperts):
                    module.down_proj_bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _init_rope(self, device) -> None:
        # One table for every position: a step then only indexes it. Gemma 3's sliding-window layers have their own.
        self._rope_table("rope", self.spec.rope_inv_freq, self.spec.rope_attention_scaling, device)
        if self.spec.gemma:
            gemma = self.spec.gemma
            self._rope_table("rope_local", gemma.local_rope_inv_freq, gemma.local_rope_attention_scaling, device)

    def _rope_table(self, name: str, inv_freq, scaling: float, device) -> None:
        """Buffers {name}_cos, {name}_sin (P, head_dim): fp32 math, exactly as transformers, then cast."""
        inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)  # (head_dim // 2,)
        positions = torch.arange(self.spec.max_position_embeddings, device=device).float()  # (P,)
        freqs = positions[:, None] * inv_freq  # (P, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, head_dim)
        self.register_buffer(f"{name}_cos", (emb.cos() * scaling).to(self.dtype), persistent=False)
        self.register_buffer(f"{name}_sin", (emb.sin() * scaling).to(self.dtype), persistent=False)

    def kv_layout(self, block_size: int) -> KVLayout:
        """The layout of this rank's KV pool: its KV heads."""
        return KVLayout.of(self.spec, block_size, str(self.dtype).removeprefix("torch."), self.shard)

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache, row_embeds=None
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden). positions < max_position_embeddings.

        row_embeds: optional (rows (R,) long, embeddings (R, hidden)) replacing the token embeddings of those flat-batch
        rows: image embeddings at their placeholders (engine/multimodal/processing.py's embeddings_in_span)."""
        x = self._embed(input_ids)  # (T, hidden)
        if row_embeds is not None:
            rows, embeds = row_embeds
            x[rows] = embeds.to(x.dtype)  # transformers casts the image features to the embeddings' dtype too
        rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))  # (T, 1, head_dim)
        local = (self.rope_local_cos[positions].unsqueeze(1), self.rope_local_sin[positions].unsqueeze(1)) \
            if self.spec.gemma else rope
        for i, layer in enumerate(self.layers):
            cos, sin = local if self.spec.sliding_windows[i] else rope
            x = layer(x, cos, sin, meta.group(kv_cache.layout.place(i)[0]), *kv_cache.layer(i))
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (T, hidden). Under tensor parallelism each rank looks up the ids of its vocabulary rows,
        zeros the others, and the ranks' rows are summed (vocab-parallel, as vLLM's VocabParallelEmbedding)."""
        if self.shard.size == 1:
            x = self.embed_tokens(input_ids)
        else:
            mine = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)  # (T,)
            x = self.embed_tokens(torch.where(mine, input_ids - self.vocab.start, 0))  # (T, hidden)
            x = self.shard.reduce(x.masked_fill_(~mine[:, None], 0))
        if self.spec.gemma:  # Gemma 3 scales its embeddings by sqrt(hidden_size), a float32 scalar cast to the dtype
            x = x * torch.tensor(self.spec.hidden_size**0.5).to(x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, hidden) -> logits (R, vocab) float32. Under tensor parallelism a collective: each rank
        computes its vocabulary rows' logits and the ranks' zero-padded slices are summed, on every rank."""
        logits = self.lm_head(hidden).float()  # (R, this rank's vocab rows)
        if self.shard.size > 1:
            whole = logits.new_zeros((hidden.shape[0], self.spec.vocab_size))  # (R, vocab)
            whole[:, self.vocab] = logits
            logits = self.shard.reduce(whole)
        cap = self.spec.gemma.final_logit_softcapping if self.spec.gemma else None
        return logits if cap is None else torch.tanh(logits / cap) * cap
