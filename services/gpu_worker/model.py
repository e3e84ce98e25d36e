"""Our own Llama-family forward (SmolLM2 = LlamaForCausalLM) over a paged KV cache, shardable by heads.

Why our own instead of ``transformers``' model: the scheduler packs the tokens of many sequences
(decode steps, prefill chunks, speculative "verify" runs) into one step over a block-paged KV
cache, and tensor parallelism shards heads and MLP columns; ``LlamaForCausalLM`` with a
``DynamicCache`` per sequence allows neither without copying every sequence's cache each step, and
its per-layer Python overhead (~4x ours) dominates a 135M model. Weights, RoPE parameters (the
config's theta and scaling, computed by transformers' own ``ROPE_INIT_FUNCTIONS``) and the RMSNorm
arithmetic are transformers'; tests check logits against ``LlamaForCausalLM`` and greedy text
against ``generate``.

Public API (used by the scheduler, and by tensor parallelism / speculative decoding on top):

* ``LlamaConfig.from_pretrained(path)`` (``from_hf(config)`` for a transformers config) — the shape
  of the model; ``Shard(rank, world)`` — which slice a
  rank holds. ``Shard.check(config)`` raises ValueError unless ``world`` divides the attention
  heads, the KV heads and the MLP width (SmolLM2: 9/3 heads, so TP=1 or 3).
* ``LlamaModel.load(path, device=, dtype=, shard=, all_reduce=, allow_download=, prepack=)`` — weights
  from an HF directory (safetensors) or, with ``allow_download``, a hub id through ``from_pretrained``.
  ``prepack`` (default: on for CPU float32) adds oneDNN-prepacked copies of the weights for steps of
  more than one row (``packed.py``: a verify pass of 5 tokens costs ~1.45 decode steps, not ~2.2).
  Rank r holds q/k/v rows of its heads, o_proj columns of its heads, gate/up rows and down_proj
  columns of its MLP slice; embeddings, norms and the (tied) LM head are replicated.
  ``all_reduce(t)`` is called (in place, sum over ranks) after o_proj and after down_proj of every
  layer; identity when ``world == 1``. Every rank must call ``forward`` with the same segments.
* ``model.new_cache(num_blocks, block_tokens, dtype)`` -> ``KVCache``: per layer K and V of shape
  ``[num_blocks * block_tokens, local_kv_heads, head_dim]``; token position p of a sequence lives
  at slot ``block_table[p // block_tokens] * block_tokens + p % block_tokens``.
* ``model.forward(segments, cache)`` -> one logits tensor per segment (float32). A ``Segment`` is
  one sequence's new tokens in this step: ``token_ids`` at positions ``start .. start+n-1`` (the KV
  of positions ``< start`` must already be in ``cache`` at its ``block_table``). The step writes
  the new tokens' K/V into the cache, then attends over positions ``0 .. start+i`` for token i.
  ``all_logits=False`` returns ``[1, vocab]`` (the last token: decode and prefill), ``True``
  returns ``[n, vocab]`` (every position: a speculative *verify* run of k draft tokens).
  ``model.pooled(inputs)`` -> mean-pooled final hidden states (after the final norm) of token id
  lists, one padded batch forward without KV cache (embeddings, ``embed.py``; ``world == 1`` only).
  Rolling back rejected draft tokens needs no model call: the caller keeps only the accepted
  length; slots past it are overwritten by the next step (see ``scheduler.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from services.gpu_worker import weights_cache
from services.gpu_worker.packed import Linear, Packer, can_prepack
from services.gpu_worker.plan import Segment, StepPlan

log = structlog.get_logger(__name__)

AllReduce = Callable[[Tensor], None]
"""Sum a tensor over the tensor-parallel group, in place."""


def _no_reduce(_t: Tensor) -> None:
    return None


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (from an HF ``config.json``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    max_positions: int
    tied: bool
    inv_freq: tuple[float, ...]
    rope_scaling: float = 1.0

    @classmethod
    def from_hf(cls, config: object) -> LlamaConfig:
        """From a transformers ``LlamaConfig`` (RoPE parameters computed by transformers)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = config
        model_type = getattr(c, "model_type", "")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model type {model_type!r} is not supported by the cloud engine; use a Llama-family one")
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or model_type == "qwen2":
            raise ValueError("checkpoints with attention/MLP biases are not supported by the cloud engine yet")
        rope_type = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} depends on the sequence length and is not supported")
        rope = LlamaRotaryEmbedding(c)  # type: ignore[arg-type]
        heads = int(c.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(c.hidden_size)  # type: ignore[attr-defined]
        return cls(
            hidden=hidden,
            layers=int(c.num_hidden_layers),  # type: ignore[attr-defined]
            heads=heads,
            kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or hidden // heads),
            intermediate=int(c.intermediate_size),  # type: ignore[attr-defined]
            vocab=int(c.vocab_size),  # type: ignore[attr-defined]
            eps=float(c.rms_norm_eps),  # type: ignore[attr-defined]
            max_positions=int(getattr(c, "max_position_embeddings", 2048)),
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            inv_freq=tuple(float(x) for x in rope.inv_freq.tolist()),
            rope_scaling=float(rope.attention_scaling),
        )

    @classmethod
    def from_config_json(cls, data: dict[str, Any]) -> LlamaConfig | None:
        """From a Llama ``config.json`` with the default RoPE, without importing transformers; None
        for anything else (another model type, scaled RoPE: :meth:`from_pretrained` asks transformers).

        Why: importing transformers' Llama config and rotary embedding costs ~3 s of CPU at every
        start, most of a restarted cloud worker's time (docs/cloud.md, *Startup*). The defaults are
        ``transformers.LlamaConfig``'s and ``inv_freq`` is its ``compute_default_rope_parameters``,
        term for term (a test compares this with :meth:`from_hf`).
        """
        c = data
        if c.get("model_type") != "llama" or c.get("attention_bias") or c.get("mlp_bias"):
            return None
        rope = c.get("rope_parameters") or {}
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            return None
        theta = float(rope.get("rope_theta", c.get("rope_theta", 10_000.0)))

        def num(key: str, default: Any) -> Any:  # a null in config.json means the default, as in transformers
            value = c.get(key)
            return default if value is None else value

        heads = int(num("num_attention_heads", 32))
        hidden = int(num("hidden_size", 4096))
        head_dim = int(num("head_dim", hidden // heads))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return cls(
            hidden=hidden,
            layers=int(num("num_hidden_layers", 32)),
            heads=heads,
            kv_heads=int(num("num_key_value_heads", heads)),
            head_dim=head_dim,
            intermediate=int(num("intermediate_size", 11008)),
            vocab=int(num("vocab_size", 32000)),
            eps=float(num("rms_norm_eps", 1e-6)),
            max_positions=int(num("max_position_embeddings", 2048)),
            tied=bool(num("tie_word_embeddings", False)),
            inv_freq=tuple(float(x) for x in inv_freq.tolist()),
            rope_scaling=1.0,
        )

    @classmethod
    def from_pretrained(cls, path: str, *, allow_download: bool = False) -> LlamaConfig:
        """The config of an HF directory or hub id: :meth:`from_config_json` where it applies, else
        through ``transformers.AutoConfig`` and :meth:`from_hf`."""
        config_file = Path(path) / "config.json"
        if config_file.is_file():
            config = cls.from_config_json(json.loads(config_file.read_text()))
            if config is not None:
                return config
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(path, local_files_only=not allow_download))

    def kv_bytes_per_token(self, dtype: torch.dtype, world: int = 1) -> int:
        """KV bytes one token occupies on one rank."""
        return self.layers * 2 * (self.kv_heads // world) * self.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Shard:
    """The slice of the model one tensor-parallel rank holds."""

    rank: int = 0
    world: int = 1

    def check(self, config: LlamaConfig) -> None:
        """ValueError (one sentence, with the fix) unless ``world`` divides heads, KV heads and MLP width."""
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world}")
        for what, n in (("attention heads", config.heads), ("KV heads", config.kv_heads)):
            if n % self.world:
                kv, heads = config.kv_heads, config.heads
                divisors = [d for d in range(1, kv + 1) if kv % d == 0 and heads % d == 0]
                raise ValueError(
                    f"tensor-parallel degree {self.world} does not divide the model's {n} {what}; use one of {divisors}"
                )
        if config.intermediate % self.world:
            raise ValueError(f"tensor-parallel degree {self.world} does not divide the MLP width {config.intermediate}")

    def part(self, n: int) -> slice:
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)


@dataclass
class KVCache:
    """Paged K/V of one rank: ``k[layer]`` / ``v[layer]`` are ``[slots, local_kv_heads, head_dim]``."""

    k: list[Tensor]
    v: list[Tensor]
    block_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] // self.block_tokens

    def read_block(self, block: int) -> Tensor:
        """One block as ``[layers, 2, kv_heads, block_tokens, head_dim]`` (the Redis block layout), a copy."""
        s = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
        k = torch.stack([t[s] for t in self.k])
        v = torch.stack([t[s] for t in self.v])
        return torch.stack((k, v), dim=1).transpose(2, 3).contiguous()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into block ``dst`` on the device (a fork's copy of a partial block)."""
        bt = self.block_tokens
        s, d = slice(src * bt, (src + 1) * bt), slice(dst * bt, (dst + 1) * bt)
        for k, v in zip(self.k, self.v, strict=True):
            k[d].copy_(k[s])
            v[d].copy_(v[s])

    def write_block(self, block: int, data: Tensor) -> None:
        """Inverse of :meth:`read_block`."""
        s = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
        data = data.to(self.k[0].device).transpose(2, 3)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k[s].copy_(data[layer, 0])
            v[s].copy_(data[layer, 1])


@dataclass
class _Layer:
    ln1: Tensor
    wqkv: Linear
    wo: Linear
    ln2: Tensor
    w_gate_up: Linear
    w_down: Linear


class LlamaModel:
    """One rank's slice of a Llama-family model (see the module docstring)."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        shard: Shard = Shard(),
        all_reduce: AllReduce | None = None,
        prepack: bool | None = None,
        fused: Mapping[str, Tensor] | None = None,
    ) -> None:
        """``fused``: q/k/v and gate/up weights already concatenated (``fused_weights()`` of an earlier
        load, weights_cache.py), used where they equal the concatenation of ``weights``."""
        shard.check(config)
        # None: prepack where it helps (CPU float32, packed.py); it keeps a second copy of the weights.
        pack = can_prepack(device, dtype) if prepack is None else prepack and can_prepack(device, dtype)
        self.config = config
        self.shard = shard
        self.device = device
        self.dtype = dtype
        self.all_reduce = all_reduce if shard.world > 1 and all_reduce is not None else _no_reduce
        if shard.world > 1 and all_reduce is None:
            raise ValueError("a sharded model needs an all_reduce hook")
        self.local_heads = config.heads // shard.world
        self.local_kv_heads = config.kv_heads // shard.world
        d = config.head_dim

        def get(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=dtype)

        heads, kv, mlp = shard.part(config.heads * d), shard.part(config.kv_heads * d), shard.part(config.intermediate)
        # Packed in the background (packed.py: the model serves before ~1 s of reordering is done), the
        # LM head first: every step needs it, even a one-row one.
        self.packer = Packer()
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        head = self.embed if config.tied or "lm_head.weight" not in weights else get("lm_head.weight")
        self.lm_head = Linear(head, prepack=pack, single_row_packed=True, packer=self.packer)
        self.layers: list[_Layer] = []
        self.fused_built = False
        """Whether any fused weight was concatenated here (not taken from ``fused``)."""
        for i in range(config.layers):
            p = f"model.layers.{i}."
            q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
            qkv, built_qkv = weights_cache.fused(p + "qkv", (q[heads], k[kv], v[kv]), fused)
            gate_up, built_gate_up = weights_cache.fused(p + "gate_up", (gate[mlp], up[mlp]), fused)
            self.fused_built |= built_qkv or built_gate_up
            self.layers.append(
                _Layer(
                    ln1=get(p + "input_layernorm.weight"),
                    wqkv=Linear(qkv, prepack=pack, packer=self.packer),
                    wo=Linear(
                        get(p + "self_attn.o_proj.weight")[:, heads].contiguous(), prepack=pack, packer=self.packer
                    ),
                    ln2=get(p + "post_attention_layernorm.weight"),
                    w_gate_up=Linear(gate_up, prepack=pack, packer=self.packer),
                    w_down=Linear(
                        get(p + "mlp.down_proj.weight")[:, mlp].contiguous(), prepack=pack, packer=self.packer
                    ),
                )
            )
        self.packer.start()
        positions = torch.arange(config.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * torch.tensor(config.inv_freq, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * config.rope_scaling).to(device=device, dtype=dtype)
        self._sin = (emb.sin() * config.rope_scaling).to(device=device, dtype=dtype)
        self._q_size = self.local_heads * d
        self._kv_size = self.local_kv_heads * d

    @classmethod
    def load(
        cls,
        path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        shard: Shard = Shard(),
        all_reduce: AllReduce | None = None,
        allow_download: bool = False,
        prepack: bool | None = None,
        cache_dir: Path | None = None,
    ) -> LlamaModel:
        """Load from an HF directory (safetensors) or a hub id (cached, or downloaded if allowed).

        ``cache_dir``: keep the fused weights there and map them on later loads (weights_cache.py; a
        CPU model of a safetensors directory only: on a GPU they are copied to the device anyway)."""
        directory = Path(path)
        config = LlamaConfig.from_pretrained(path, allow_download=allow_download)
        cache_file = cached = None
        if directory.is_dir() and any(directory.glob("*.safetensors")):
            weights = _read_safetensors(directory)
            if cache_dir is not None and device.type == "cpu":
                files = sorted(directory.glob("*.safetensors"))
                identity = {"config": dataclasses.asdict(config), "shard": dataclasses.asdict(shard), "dtype": dtype}
                key = weights_cache.cache_key(files, identity)
                cache_file = cache_dir / f"{key}.safetensors"
                cached = weights_cache.read(cache_file)
        else:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=not allow_download)
            weights = dict(hf.state_dict())
        model = cls(
            config,
            weights,
            device=device,
            dtype=dtype,
            shard=shard,
            all_reduce=all_reduce,
            prepack=prepack,
            fused=cached,
        )
        if cache_file is not None:
            log.info("cloud_weights_cache", hit=not model.fused_built, path=str(cache_file))
            if model.fused_built:
                weights_cache.write(cache_file, model.fused_weights())
        return model

    def fused_weights(self) -> dict[str, Tensor]:
        """The q/k/v and gate/up weights as concatenated (the ``fused`` argument of a later load)."""
        out: dict[str, Tensor] = {}
        for i, layer in enumerate(self.layers):
            out[f"model.layers.{i}.qkv"] = layer.wqkv.weight
            out[f"model.layers.{i}.gate_up"] = layer.w_gate_up.weight
        return out

    def new_cache(self, num_blocks: int, block_tokens: int, dtype: torch.dtype) -> KVCache:
        shape = (num_blocks * block_tokens, self.local_kv_heads, self.config.head_dim)
        n = self.config.layers
        return KVCache(
            k=[_zeros(shape, dtype, self.device) for _ in range(n)],
            v=[_zeros(shape, dtype, self.device) for _ in range(n)],
            block_tokens=block_tokens,
        )

    def _rms(self, x: Tensor, w: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.eps)
        return w * h.to(x.dtype)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], cache: KVCache) -> list[Tensor]:
        """Run one packed step (see the module docstring); returns float32 logits per segment."""
        d = self.config.head_dim
        g = self.local_heads // self.local_kv_heads
        plan = StepPlan.build(segments, cache.block_tokens, g, self.device)
        cos = self._cos[plan.positions][:, None, :]
        sin = self._sin[plan.positions][:, None, :]
        x = self.embed[plan.tokens]
        n = x.shape[0]
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer.ln1)
            qkv = layer.wqkv(h)
            q = self._rope(qkv[:, : self._q_size].view(n, self.local_heads, d), cos, sin)
            k_end = self._q_size + self._kv_size
            k = self._rope(qkv[:, self._q_size : k_end].view(n, self.local_kv_heads, d), cos, sin)
            v = qkv[:, k_end:].view(n, self.local_kv_heads, d)
            kc, vc = cache.k[li], cache.v[li]
            kc.index_copy_(0, plan.slots, k.to(kc.dtype))
            vc.index_copy_(0, plan.slots, v.to(vc.dtype))
            attn = torch.empty(n, self.local_kv_heads, g, d, dtype=x.dtype, device=x.device)
            qg = q.view(n, self.local_kv_heads, g, d)
            if plan.decode_rows is not None:
                # Decode rows: one query each; the g query heads of a KV head form the query axis.
                keys = kc[plan.decode_index].to(x.dtype).transpose(1, 2)  # [B, kvh, L, d]
                vals = vc[plan.decode_index].to(x.dtype).transpose(1, 2)
                out = F.scaled_dot_product_attention(qg[plan.decode_rows], keys, vals, attn_mask=plan.decode_mask)
                attn[plan.decode_rows] = out
            for row, count, index, mask in plan.extends:
                keys = kc[index].to(x.dtype).transpose(0, 1)  # [kvh, L, d]
                vals = vc[index].to(x.dtype).transpose(0, 1)
                qs = qg[row : row + count].permute(1, 2, 0, 3).reshape(self.local_kv_heads, g * count, d)
                out = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask)
                attn[row : row + count] = out.view(self.local_kv_heads, g, count, d).permute(2, 0, 1, 3)
            o = layer.wo(attn.view(n, self._q_size))
            self.all_reduce(o)
            x = x + o
            h = self._rms(x, layer.ln2)
            gu = layer.w_gate_up(h)
            half = gu.shape[-1] // 2
            down = layer.w_down(F.silu(gu[:, :half]) * gu[:, half:])
            self.all_reduce(down)
            x = x + down
        h = self._rms(x[plan.logit_rows], self.norm)
        logits = self.lm_head(h).float()
        return list(torch.split(logits, plan.logit_counts))

    def decode_fixed(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, lengths: Tensor, tables: Tensor, cache: KVCache
    ) -> Tensor:
        """One decode step of ``B`` rows with shapes fixed by ``B`` and the table width ``W`` (graphs.py).

        ``tokens``, ``positions``, ``slots``, ``lengths``: ``[B]`` int64 (the new token, its position, the
        cache slot its K/V goes to, and the context length including it); ``tables``: ``[B, W]`` block
        ids (entries past a row's blocks may be anything valid: they are masked by ``lengths``).
        Returns float32 logits ``[B, vocab]``. Nothing here reads a value on the host, so the step can
        be captured as a CUDA graph; padding rows point ``slots`` at a slot no sequence uses.
        """
        with torch.inference_mode():
            d = self.config.head_dim
            g = self.local_heads // self.local_kv_heads
            bt = cache.block_tokens
            b, width = tables.shape
            index = (tables[:, :, None] * bt + torch.arange(bt, device=tables.device)).view(b, width * bt)
            mask = (torch.arange(width * bt, device=tables.device)[None, :] < lengths[:, None]).view(b, 1, 1, -1)
            cos = self._cos[positions][:, None, :]
            sin = self._sin[positions][:, None, :]
            x = self.embed[tokens]
            for li, layer in enumerate(self.layers):
                h = self._rms(x, layer.ln1)
                qkv = layer.wqkv(h)
                q = self._rope(qkv[:, : self._q_size].view(b, self.local_heads, d), cos, sin)
                k_end = self._q_size + self._kv_size
                k = self._rope(qkv[:, self._q_size : k_end].view(b, self.local_kv_heads, d), cos, sin)
                v = qkv[:, k_end:].view(b, self.local_kv_heads, d)
                kc, vc = cache.k[li], cache.v[li]
                kc.index_copy_(0, slots, k.to(kc.dtype))
                vc.index_copy_(0, slots, v.to(vc.dtype))
                keys = kc[index].to(x.dtype).transpose(1, 2)  # [B, kvh, W*bt, d]
                vals = vc[index].to(x.dtype).transpose(1, 2)
                qg = q.view(b, self.local_kv_heads, g, d)
                attn = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask)
                o = layer.wo(attn.reshape(b, self._q_size))
                self.all_reduce(o)
                x = x + o
                h = self._rms(x, layer.ln2)
                gu = layer.w_gate_up(h)
                half = gu.shape[-1] // 2
                down = layer.w_down(F.silu(gu[:, :half]) * gu[:, half:])
                self.all_reduce(down)
                x = x + down
            return self.lm_head(self._rms(x, self.norm)).float()

    @torch.inference_mode()
    def pooled(self, inputs: Sequence[Sequence[int]]) -> Tensor:
        """Mean-pooled final hidden states of each input: float32 ``[len(inputs), hidden]``, not normalised.

        One forward over the inputs right-padded to the longest, with no KV cache: causal attention
        in which no token attends to padding. The hidden states are those after the final RMSNorm
        (what the LM head reads); the mean is over each input's own tokens. Needs ``world == 1``
        (no all-reduce here) and non-empty inputs no longer than ``max_positions``.
        """
        cfg = self.config
        d = cfg.head_dim
        g = self.local_heads // self.local_kv_heads
        b, width = len(inputs), max(len(ids) for ids in inputs)
        tokens = torch.zeros(b, width, dtype=torch.long)
        for row, ids in enumerate(inputs):
            tokens[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        tokens = tokens.to(self.device)
        lengths = torch.tensor([len(ids) for ids in inputs], device=self.device)
        valid = torch.arange(width, device=self.device)[None, :] < lengths[:, None]  # [B, L]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = causal[None, None] & valid[:, None, None, :]  # [B, 1, L, L]: never a padded key
        cos = self._cos[:width][None, :, None, :]
        sin = self._sin[:width][None, :, None, :]
        x = self.embed[tokens].reshape(b * width, cfg.hidden)
        for layer in self.layers:
            h = self._rms(x, layer.ln1)
            qkv = layer.wqkv(h)
            k_end = self._q_size + self._kv_size
            q = self._rope(qkv[:, : self._q_size].view(b, width, self.local_heads, d), cos, sin)
            k = self._rope(qkv[:, self._q_size : k_end].view(b, width, self.local_kv_heads, d), cos, sin)
            v = qkv[:, k_end:].view(b, width, self.local_kv_heads, d)
            k = k.repeat_interleave(g, dim=2)
            v = v.repeat_interleave(g, dim=2)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
            )  # [B, heads, L, d]
            x = x + layer.wo(attn.transpose(1, 2).reshape(b * width, self._q_size))
            h = self._rms(x, layer.ln2)
            gu = layer.w_gate_up(h)
            half = gu.shape[-1] // 2
            x = x + layer.w_down(F.silu(gu[:, :half]) * gu[:, half:])
        hidden = self._rms(x, self.norm).float().view(b, width, cfg.hidden)
        weights = valid.to(torch.float32)[:, :, None]
        return (hidden * weights).sum(dim=1) / lengths.to(torch.float32)[:, None]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.zeros``, whose pages on CPU the kernel zeroes when first touched instead of now.

    Why: ``torch.zeros`` writes every byte of the KV budget (512 MiB by default) at start, ~0.5 s of
    CPU on an idle machine and seconds on a loaded one, before a restarted worker serves; ``calloc``
    (numpy's zeros) maps fresh zero pages, filled as the cache is used.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _read_safetensors(directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    weights: dict[str, Tensor] = {}
    for f in files or [p.name for p in sorted(directory.glob("*.safetensors"))]:
        weights.update(load_file(str(directory / f)))
    return weights
