"""`CausalLM`: the decoder of every family (decoder_layer.py's layers between the embeddings
and the final norm) and its LM head, with checkpoint loading.

Parameter names equal those of Hugging Face checkpoints (model.embed_tokens.weight,
model.layers.{i}.self_attn.q_proj.weight, ..., model.norm.weight, lm_head.weight), so weights
load by name; a family's fused checkpoint tensors are split on the way in (family.py).
Activations are packed: T tokens of B sequences in one [T, H] tensor, no padding; where each
sequence starts and what it attends to is in `AttentionMetadata`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.attention.base import AttentionBackend, AttentionMetadata
from eaglebatch.attention.torch_backend import TorchAttentionBackend
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.decoder_layer import DecoderLayer, make_norm, query_position_scale
from eaglebatch.model.gguf_checkpoint import GgufCheckpoint
from eaglebatch.model.recurrent_state import RecurrentStates
from eaglebatch.model.registry import family_of
from eaglebatch.model.rotary import RotaryEmbedding
from eaglebatch.model.weights import (
    check_shapes,
    checkpoint_shapes,
    is_mtp_tensor,
    iter_tensors,
    load_named_tensors,
    text_tower_name,
)

# Checkpoint tensors that are not parameters of ours: old checkpoints store RoPE buffers.
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)


def _head_name(name: str, cfg: ModelConfig) -> str:
    """A sequence classifier's score head is loaded as the LM head."""
    return "lm_head.weight" if cfg.head_outputs and name == "score.weight" else name


def _embedding(num: int, dim: int, **factory) -> nn.Embedding:
    """nn.Embedding, without its random init when built on the meta device (weights are loaded
    afterwards): normal_ on meta runs a Python decomposition whose first call costs ~1.1 s."""
    weight = torch.empty(num, dim, **factory)
    if weight.device.type != "meta":
        return nn.Embedding(num, dim, **factory)
    return nn.Embedding(num, dim, _weight=weight)


def _kind_head_dim(cfg: ModelConfig, windowed: bool) -> int:
    """The head dim of the full (or windowed) layers: one per kind (ModelConfig)."""
    kind = (i for i in range(cfg.num_hidden_layers) if (cfg.window_of(i) is None) != windowed)
    return next((cfg.heads_of(i)[2] for i in kind), cfg.head_dim)


class DecoderModel(nn.Module):
    """Embeddings, layers, final norm and the RoPE tables: `rotary_emb` (full-attention layers)
    and, where sliding layers have their own base or head dim, `rotary_local`; with per-layer
    embeddings (cfg.per_layer_input_size) their table, projection and norm."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None, **factory) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, **factory) for i in range(cfg.num_hidden_layers)
        )
        self.norm = make_norm(cfg, cfg.hidden_size, **factory)
        device = factory.get("device")
        full_dim, local_dim = _kind_head_dim(cfg, False), _kind_head_dim(cfg, True)
        self.rotary_emb = RotaryEmbedding(cfg, max_positions, device=device, head_dim=full_dim)
        self.rotary_local = None
        if cfg.rope_local_theta is not None or local_dim != full_dim:
            local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta,
                                        rope_scaling=None)  # fmt: skip
            self.rotary_local = RotaryEmbedding(local, max_positions, device=device,
                                                head_dim=local_dim)  # fmt: skip
        if cfg.per_layer_input_size:
            width = cfg.num_hidden_layers * cfg.per_layer_input_size  # L * P
            self.embed_tokens_per_layer = _embedding(cfg.vocab_size, width, **factory)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False,
                                                        **factory)  # fmt: skip
            self.per_layer_projection_norm = make_norm(cfg, cfg.per_layer_input_size, **factory)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: ((norm(proj(embeds) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)), the
        per-layer embeddings of the tokens `input_ids` [T] whose embeddings are `embeds`
        [T, H] (already scaled)."""
        t, p = input_ids.shape[0], self.per_layer_projection_norm.weight.shape[0]
        ids = self.embed_tokens_per_layer(input_ids) * torch.tensor(p**0.5, dtype=embeds.dtype)
        proj = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5  # [T, L*P]
        proj = self.per_layer_projection_norm(proj.view(t, -1, p))  # [T, L, P]
        return (proj + ids.view(t, -1, p)) * 2.0**-0.5


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final-normed hidden states; `compute_logits` maps the
    rows you need (e.g. each sequence's last token) to float32 logits.

    A float32 CPU run swaps the CPU fast path into `run_layers` and `lm_head_forward`
    (eaglebatch/cpu: `accelerate`); the code here is the plain torch it is tested against."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        backend: AttentionBackend | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
    ) -> None:
        """`max_positions` bounds the RoPE table (default: cfg.max_model_len)."""
        super().__init__()
        if backend is None:
            backend = TorchAttentionBackend()
        self.config = cfg
        self.backend = backend
        self.states: RecurrentStates | None = None  # linear-attention layers' (attach_states)
        # activations and the KV cache are in the model's dtype
        windows = {cfg.window_of(i) for i in range(cfg.num_hidden_layers)} - {None}
        heads = tuple(cfg.heads_of(i) for i in range(cfg.num_hidden_layers))
        backend.configure(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype,
                          dtype, cfg.attention_scale, windows=tuple(sorted(windows)),
                          layer_heads=heads if len(set(heads)) > 1 else (),
                          sinks=cfg.attention_sinks)  # fmt: skip
        factory = {"dtype": dtype, "device": device}
        self.model = self._build_model(cfg, max_positions, **factory)
        # Tied: the LM head is the embedding matrix and there is no lm_head parameter. A
        # sequence classifier's head is its score head (checkpoint tensor score.weight).
        outputs = cfg.head_outputs or cfg.vocab_size
        self.lm_head = (
            None
            if cfg.tie_word_embeddings and not cfg.head_outputs
            else nn.Linear(cfg.hidden_size, outputs, bias=False, **factory)
        )

    def _build_model(self, cfg: ModelConfig, max_positions: int | None, **factory) -> nn.Module:
        return DecoderModel(cfg, max_positions, **factory)

    def rotaries(self) -> list[RotaryEmbedding]:
        """The RoPE tables (one per kind of layer)."""
        local = self.model.rotary_local
        return [self.model.rotary_emb] + ([] if local is None else [local])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, H]
        h = self.model.embed_tokens(input_ids)
        scale = self.config.embedding_multiplier
        return h if scale == 1.0 else h * torch.tensor(scale, dtype=h.dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: AttentionBackend | None = None,
        max_positions: int | None = None,
        skip: frozenset[str] = frozenset(),
        gguf: GgufCheckpoint | str | os.PathLike[str] | None = None,
    ) -> CausalLM:
        """Config + weights from a Hugging Face checkpoint directory, without random init; the
        weights from GGUF file `gguf` when given (model/gguf_checkpoint.py). Parameters named
        in `skip` are left unloaded (allocated, never written, so not resident until used):
        the caller replaces them (GGUF blocks, cpu/quantized.py)."""
        cfg = ModelConfig.from_dir(path)
        with torch.device("meta"):
            model = cls(cfg, backend=backend, dtype=dtype, max_positions=max_positions)
        model.to_empty(device=device)
        for rotary in model.rotaries():
            rotary.rebuild()
        if gguf is not None:
            model.load_gguf(gguf, skip)
        else:
            model.load_weights(path, skip)
        return model.eval()

    @classmethod
    def check_checkpoint(
        cls, path: str | os.PathLike[str], cfg: ModelConfig,
        gguf: str | os.PathLike[str] | None = None,
    ) -> dict[str, tuple[int, ...]]:  # fmt: skip
        """Raises ValueError when the checkpoint in `path` (or GGUF file `gguf`) cannot load
        into a model of `cfg` (a truncated file, a missing, unexpected or misshapen tensor),
        reading headers only; returns the checkpoint's {name: shape} of the model's tensors."""
        with torch.device("meta"):
            model = cls(cfg, max_positions=2)
        expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if gguf is not None:
            found = model.gguf_checkpoint(gguf).shapes()
        else:
            found = {n: s for n, s in checkpoint_shapes(path).items() if not is_mtp_tensor(n)}
        if cfg.text_tower:
            found = {m: s for n, s in found.items() if (m := text_tower_name(n)) is not None}
        if gguf is None:
            family = family_of(cfg.model_type)
            found = dict(p for n, s in found.items() for p in family.split(n, s, cfg))
            found = {_head_name(n, cfg): s for n, s in found.items()}
        source = f"checkpoint {gguf or path}"
        check_shapes(expected, found, ignore=model._ignored_tensors(), source=source)
        return {n: s for n, s in found.items() if n in expected}

    def gguf_checkpoint(self, gguf: str | os.PathLike[str]) -> GgufCheckpoint:
        """GGUF file `gguf`'s tensors for this model's parameters."""
        return GgufCheckpoint(gguf, self.config, [n for n, _ in self.named_parameters()])

    def load_gguf(
        self, gguf: GgufCheckpoint | str | os.PathLike[str], skip: frozenset[str] = frozenset()
    ) -> None:
        """Loads every parameter but those in `skip` from GGUF file `gguf` (or its opened
        checkpoint), one dequantized tensor at a time (raises on missing tensors)."""
        ck = gguf if isinstance(gguf, GgufCheckpoint) else self.gguf_checkpoint(gguf)
        wanted = [n for n, _ in self.named_parameters() if n not in skip]
        load_named_tensors(self, ck.iter_float32(wanted), source=f"checkpoint {ck.path}",
                           skip=skip)  # fmt: skip

    def _ignored_tensors(self) -> tuple[str, ...]:
        """A tied checkpoint may or may not contain lm_head.weight; layers sharing another's
        KV cache have no k/v projections or norms of their own, whatever the file holds."""
        cfg = self.config
        shared = tuple(f"layers.{i}.self_attn.{n}.weight"
                       for i in range(cfg.num_hidden_layers) if cfg.kv_source(i) != i
                       for n in ("k_proj", "v_proj", "k_norm", "v_norm"))  # fmt: skip
        return _IGNORED_TENSORS + (("lm_head.weight",) if self.lm_head is None else ()) + shared

    def load_weights(
        self, path: str | os.PathLike[str], skip: frozenset[str] = frozenset()
    ) -> None:
        """Loads every parameter but those in `skip` from the *.safetensors files in `path`
        (raises on missing or unexpected tensors)."""
        rename = text_tower_name if self.config.text_tower else (lambda n: n)
        # left unread: `skip`, and the MTP layer (a drafter's, speculative/mtp.py)
        tensors = iter_tensors(path, skip=lambda n: is_mtp_tensor(n) or rename(n) in skip)
        if self.config.text_tower:
            tensors = ((m, t) for n, t in tensors if (m := text_tower_name(n)) is not None)
        family = family_of(self.config.model_type)
        tensors = (p for n, t in tensors for p in family.split(n, t, self.config))
        tensors = ((_head_name(n, self.config), t) for n, t in tensors)
        load_named_tensors(self, tensors, ignore=self._ignored_tensors(),
                           source=f"checkpoint {path}", skip=skip)

    @property
    def dtype(self) -> torch.dtype:
        # the final norm's: the embedding's weight may be GGUF blocks (cpu/quantized.py)
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        """The LM head's weight: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        attn: AttentionMetadata,  # prepared by self.backend.prepare
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        capture_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Final-normed hidden states [T, H].

        With `capture_layers`, returns (hidden, captured) where captured[i] [T, H] is the hidden
        state with Hugging Face `output_hidden_states` indexing: the input of decoder layer i
        (0 = the embeddings) for i < num_hidden_layers, and for i == num_hidden_layers the
        final-normed output (the same tensor as `hidden`). The layers run from one captured
        layer to the next (`run_layers`).
        """
        h = self.embed(input_ids)  # [T, H]
        extra = {}  # per-layer embeddings [T, L, P], each layer's [T, P] its input
        if self.config.per_layer_input_size:
            extra["per_layer"] = self.model.per_layer_inputs(input_ids, h)
        num_layers = len(self.model.layers)
        captured: dict[int, torch.Tensor] = {}
        start = 0
        for i in sorted(set(capture_layers)):
            if 0 <= i < num_layers:
                if start < i:
                    h = self.run_layers(h, positions, attn, kv_caches, start, i, **extra)
                    start = i
                captured[i] = h
        h = self.run_layers(h, positions, attn, kv_caches, start, num_layers, **extra)
        h = self.model.norm(h)  # [T, H]
        if not capture_layers:
            return h
        if num_layers in capture_layers:
            captured[num_layers] = h
        bad = set(capture_layers) - set(captured)
        if bad:
            raise ValueError(f"capture_layers {sorted(bad)} outside [0, {num_layers}]")
        return h, captured

    def run_layers(
        self,
        h: torch.Tensor,  # [T, H] residual stream (the input is not modified)
        positions: torch.Tensor,  # int64 [T]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # every layer's
        first: int,
        last: int,
        per_layer: torch.Tensor | None = None,  # [T, L, P] per-layer embeddings, if any
    ) -> torch.Tensor:  # [T, H]
        """Decoder layers first..last-1 over h, each with its kind's RoPE (or none)."""
        cfg, local = self.config, self.model.rotary_local
        tables = {None: (None, None), "full": self.model.rotary_emb(positions, h.dtype)}
        if local is not None:
            tables["local"] = local(positions, h.dtype)  # ([T, 1, D], [T, 1, D])
        q_scale = query_position_scale(cfg, positions, h.dtype)  # [T, 1, 1] or None
        for i in range(first, last):
            kind = "local" if local is not None and cfg.window_of(i) is not None else "full"
            cos, sin = tables[kind if cfg.uses_rope(i) else None]
            extra = () if per_layer is None else (per_layer[:, i],)
            h = self.model.layers[i](h, cos, sin, attn, self._cache_of(i, kv_caches),
                                     self.backend, q_scale, *extra)  # fmt: skip
        return h

    def _cache_of(self, layer: int, kv_caches: list[torch.Tensor]):
        """What layer `layer` reads and writes: its KV cache, or (a linear-attention layer)
        its rows of `self.states`."""
        if not self.config.is_linear(layer):
            return kv_caches[layer]
        if self.states is None:
            raise RuntimeError("a hybrid model needs its recurrent states (attach_states)")
        return self.states.layers[layer]

    def attach_states(self, slots: int, checkpoints: int = 0) -> RecurrentStates | None:
        """Allocates the recurrent states of the linear-attention layers (None: the model has
        none) over `slots` request rows and `checkpoints` checkpoint rows."""
        cfg = self.config
        if cfg.linear_layers:
            self.states = RecurrentStates(cfg.deltanet, cfg.linear_layers, slots, checkpoints,
                                          self.device)  # fmt: skip
        return self.states

    def lm_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        """The LM head in the model's dtype (EAGLE-1 draft heads share it)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, V]
        """The LM head's logits, divided by `logits_divisor` and soft-capped where configured."""
        logits = self.lm_head_forward(hidden)  # [N, V] in the model's dtype
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
