"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) over packed tokens and their own paged KV cache.

Vocabulary (one position p of a sequence x_0, x_1, ...):
  * target feature f_p: what the draft reads from the target at p. EAGLE-1: the target's
    final-normed hidden state at p. EAGLE-3: fc(cat[target hidden states of the aux layers at
    p]) (h wide). See `target_features`.
  * draft input at p: (feature at p, token x_{p+1}); the draft output h^d_p (pre-norm) predicts
    x_{p+2}. When drafting beyond what the target has seen, the feature at p is the draft's own
    previous output h^d_{p-1} (EAGLE-3: used as is, bypassing fc; EAGLE-1: through fc like any
    feature, as in the reference).
  * the draft's single attention layer keeps K/V for position p in its own cache
    [2, num_blocks, block_size, Hkv_draft, D_draft] at the SAME slot as the target's K/V of p
    (same block tables), so it needs no allocator of its own.

Logits: EAGLE-1 applies the target's lm_head to h^d directly (no final norm: the reference's
`head(out_hidden)`); EAGLE-3 applies its own `norm` then `lm_head` over the draft vocabulary.

EAGLE-3 flags (draft_formats; as vLLM's llama_eagle3): `norm_before_fc` puts `input_norm` over
the concatenated aux states and `fc_norm` one norm per aux state before fc;
`norm_before_residual` makes the layer's residual hidden_norm(feature); `norm_output` makes
the draft's output norm(h) (both the next step's feature and the head's input, so the head
does not norm it again).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from eaglebatch.attention import get_backend
from eaglebatch.attention.base import AttentionBackend, AttentionMetadata
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.decoder_layer import MLP, RMSNorm
from eaglebatch.model.rotary import RotaryEmbedding, apply_rotary
from eaglebatch.model.weights import load_named_tensors
from eaglebatch.sampling.sampler import argmax
from eaglebatch.speculative.assistant import AssistantDraft, load_assistant
from eaglebatch.speculative.assistant_config import is_assistant
from eaglebatch.speculative.checkpoint import read_draft_tensors
from eaglebatch.speculative.draft_check import check_d2t, check_head_shapes
from eaglebatch.speculative.draft_config import (
    EAGLE1,
    DraftConfig,
    detect_kind,
    parse_draft_config,
    read_raw_config,
)
from eaglebatch.speculative.mtp import MtpDraft, load_mtp
from eaglebatch.speculative.mtp_config import states_mtp

# Checkpoint tensors that are not parameters: RoPE buffers of old checkpoints, the verifier's
# norm and lm_head some speculators versions saved beside the head (the target's are used). The
# embedding (the target's is used) and the vocabulary maps are taken out and checked in
# load_draft.
_IGNORED = ("rotary_emb.inv_freq", "verifier_norm.weight", "verifier_lm_head.weight")


class DraftAttention(nn.Module):
    """Grouped-query attention whose q/k/v read `in_features` (EAGLE-3: 2h) and whose output is h
    wide; K/V go to the draft's paged cache through the attention backend."""

    def __init__(self, cfg: ModelConfig, in_features: int, **factory) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(in_features, q_size, bias=cfg.attention_bias, **factory)
        self.k_proj = nn.Linear(in_features, kv_size, bias=cfg.attention_bias, **factory)
        self.v_proj = nn.Linear(in_features, kv_size, bias=cfg.attention_bias, **factory)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, in_features]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, h]
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(0, q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """The draft's decoder layer. Parameter names follow the checkpoints: EAGLE-1 `layers.0.*`
    (input_layernorm optional), EAGLE-3 `midlayer.*` (input_layernorm on the embedding,
    hidden_norm on the hidden, attention over both)."""

    def __init__(self, cfg: DraftConfig, **factory) -> None:
        super().__init__()
        lc = cfg.layer
        h, eps = lc.hidden_size, lc.rms_norm_eps
        self.eagle3 = cfg.kind != EAGLE1
        if cfg.has_input_layernorm:
            self.input_layernorm = RMSNorm(h, eps, **factory)
        else:
            self.input_layernorm = None
        if self.eagle3:
            self.hidden_norm = RMSNorm(h, eps, **factory)
        self.self_attn = DraftAttention(lc, 2 * h if self.eagle3 else h, **factory)
        self.post_attention_layernorm = RMSNorm(h, eps, **factory)
        self.mlp = MLP(lc, **factory)


class EagleDraft(nn.Module):
    """One EAGLE draft head bound to its target (whose embedding, and for EAGLE-1 lm_head, it
    shares; the target is referenced, not registered as a submodule).

    A float32 CPU run swaps the CPU fast path into `run_layer` (eaglebatch/cpu: `accelerate`);
    the code here is the plain torch it is tested against."""

    fixed_position = False  # chain step j queries position L-2+j (the assistant: L-2)

    def __init__(
        self,
        cfg: DraftConfig,
        target: CausalLM,
        *,
        backend: AttentionBackend | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
    ) -> None:
        """`max_positions` bounds the RoPE table (default: the target's table size)."""
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = cfg
        self._target = (target,)  # a tuple: not a submodule, its parameters are not ours
        self.backend = backend if backend is not None else get_backend(target.backend.name)
        lc = cfg.layer  # the draft's attention: activations and its KV cache in `dtype`
        self.backend.configure(lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, dtype,
                               dtype, lc.head_dim**-0.5)
        self.eagle3 = cfg.kind != EAGLE1
        h = cfg.hidden_size
        fc_in = 2 * h if not self.eagle3 else len(cfg.aux_layer_ids) * cfg.target_hidden_size
        self.fc = nn.Linear(fc_in, h, bias=cfg.fc_bias, **factory)
        layer = DraftLayer(cfg, **factory)
        if self.eagle3:
            self.midlayer = layer
            self.norm = RMSNorm(h, cfg.layer.rms_norm_eps, **factory)
            # None: a full-vocabulary head that uses the target's lm_head (see load_draft)
            self.lm_head: nn.Linear | None = nn.Linear(
                h, cfg.draft_vocab_size, bias=False, **factory
            )
            self.register_buffer("d2t", None)  # int64 [Vd] or None (identity)
            self._feature_norms(cfg, factory)
        else:
            self.layers = nn.ModuleList([layer])
        positions = max_positions or target.model.rotary_emb.max_positions
        self.rotary_emb = RotaryEmbedding(cfg.layer, positions, device=device)

    def _feature_norms(self, cfg: DraftConfig, factory: dict) -> None:
        """EAGLE-3's optional norms before fc: `input_norm` [n * ht], `fc_norm.{i}` [ht]."""
        n, ht, eps = len(cfg.aux_layer_ids), cfg.target_hidden_size, cfg.layer.rms_norm_eps
        self.input_norm = RMSNorm(n * ht, eps, **factory) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(ht, eps, **factory) for _ in range(n))
                        if cfg.fc_norm else None)  # fmt: skip

    # ---- shared pieces -------------------------------------------------------------------------

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.eagle3 else self.layers[0]

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target hidden states to capture (HF indexing) for `target_features`."""
        return self.config.aux_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary_emb]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, h]
        weight = getattr(self.target.model.embed_tokens, "weight", None)  # [V, h]; None: blocks
        if (weight is not None and input_ids.is_cpu and weight.dtype == self.dtype
                and not torch.is_grad_enabled()):  # fmt: skip
            # a row gather in numpy: the module call costs ~80 µs in a CPU round
            return torch.from_numpy(weight.detach().numpy()[input_ids.numpy()])
        return self.target.model.embed_tokens(input_ids).to(self.dtype)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, h] -> [N, Vd] logits
        # norm_output: `hidden` is normed already (forward's output)
        x = self.norm(hidden) if self.eagle3 and not self.config.norm_output else hidden
        if self.eagle3 and self.lm_head is not None:
            return self.lm_head(x)
        # EAGLE-1, or a full-vocabulary EAGLE-3 head without its own: the target's LM head
        return self.target.lm_head_forward(x)

    # ---- forward -------------------------------------------------------------------------------

    def target_features(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """[T, h] draft features from the target's captured hidden states (keys: capture_layers).
        EAGLE-1: the final-normed hidden state; EAGLE-3: fc over the concatenated aux layers."""
        if not self.eagle3:
            return captured[self.config.aux_layer_ids[0]].to(self.dtype)
        x = torch.cat([captured[i] for i in self.config.aux_layer_ids], dim=-1)  # [T, n*ht]
        x = x.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:  # after input_norm, as vLLM: one norm per aux state
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T] token x_{p+1} of each row
        features: torch.Tensor,  # [T, h] feature at p (target feature or previous draft output)
        positions: torch.Tensor,  # int64 [T] p
        meta: AttentionMetadata,  # prepared by self.backend.prepare
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] the draft's cache
        select: torch.Tensor | None = None,  # int64 [S] rows whose output is needed
    ) -> torch.Tensor:  # [S or T, h] draft output h^d (pre-norm; norm_output: normed)
        """Writes the draft K/V of every row (at meta.slot_mapping), returns the output of the
        `select`ed rows only (`run_layer`)."""
        layer = self.layer
        emb = self._embed(input_ids)  # [T, h]
        if self.eagle3:
            normed = layer.hidden_norm(features)
            residual = normed if self.config.norm_before_residual else features
            x = torch.cat((layer.input_layernorm(emb), normed), dim=-1)
        else:
            residual = self.fc(torch.cat((emb, features), dim=-1))  # the reference's order
            x = residual if layer.input_layernorm is None else layer.input_layernorm(residual)
        out = self.run_layer(x, residual, positions, meta, kv_cache, select)
        return self.norm(out) if self.eagle3 and self.config.norm_output else out

    def run_layer(
        self,
        x: torch.Tensor,  # [T, in_features] the layer's attention input
        residual: torch.Tensor,  # [T, h]
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        select: torch.Tensor | None = None,  # int64 [S]
    ) -> torch.Tensor:  # [S or T, h]
        """The draft layer after its input norms: attention (writing every row's K/V), then the
        MLP on the `select`ed rows only."""
        layer = self.layer
        cos, sin = self.rotary_emb(positions, self.dtype)  # [T, 1, D]
        attn = layer.self_attn(x, cos, sin, meta, kv_cache, self.backend)  # [T, h]
        if select is not None:
            attn, residual = attn.index_select(0, select), residual.index_select(0, select)
        h = residual + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def argmax_tokens(
        self, hidden: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:  # [N, h] -> int64 [N]
        """The draft's greedy token for each row, as TARGET ids. Only an argmax over the raw
        logits: no softmax, no probabilities (topk == 1 drafting). `allowed` (structured
        output): (rows int64 [R], bool [R, >= V] over TARGET ids), those rows' argmax is taken
        over the allowed ids only."""
        logits = self._head(hidden)  # [N, Vd]
        if allowed is not None:
            logits = self._masked(logits, *allowed)
        ids = argmax(logits)  # [N] draft ids
        if self.eagle3 and self.d2t is not None:
            if ids.is_cpu:  # numpy: two small torch ops cost ~50 µs in a CPU round
                ids_np = ids.numpy()
                return torch.from_numpy(ids_np + self.d2t.numpy()[ids_np])
            ids = ids + self.d2t.index_select(0, ids)
        return ids

    def _masked(self, logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor):
        """logits [N, Vd] with -inf at the rows' draft ids whose target ids are not allowed."""
        vd = logits.shape[-1]
        if self.eagle3 and self.d2t is not None:  # draft id i is target id i + d2t[i]
            target_ids = torch.arange(vd, device=logits.device) + self.d2t
            allowed = allowed.index_select(1, target_ids)  # [R, Vd]
        else:
            allowed = allowed[:, :vd]
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, h] -> f32 [N, Vd]
        """Draft-vocabulary logits (for tests and training; drafting uses argmax_tokens)."""
        return self._head(hidden).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """The draft's zeroed paged cache, one layer: [2, num_blocks, block_size, Hkv, D]."""
        lc = self.config.layer
        shape = (2, num_blocks, block_size, lc.num_key_value_heads, lc.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def load_draft(
    path: str | os.PathLike[str],
    target_cfg: ModelConfig,
    target_model: CausalLM,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    max_positions: int | None = None,
) -> EagleDraft | AssistantDraft | MtpDraft:
    """Loads the draft head in `path` (format detected from its tensor names; a
    gemma4_assistant folder: speculative/assistant.py; a model checkpoint stating
    mtp_num_hidden_layers: its MTP layer, speculative/mtp.py) for the target.
    Raises ValueError naming any mismatch (hidden size, vocabulary, missing / unexpected / wrongly
    shaped tensors) and FileNotFoundError when the folder, config or weights are missing."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"draft model folder not found: {os.fspath(path)}")
    raw = read_raw_config(path)
    if is_assistant(raw):  # Gemma 4's assistant drafter (speculative/assistant.py)
        return load_assistant(path, raw, target_model, dtype=dtype, device=device,
                              max_positions=max_positions)  # fmt: skip
    if states_mtp(raw):  # the model's own checkpoint: its MTP layer (speculative/mtp.py)
        return load_mtp(path, raw, target_model, dtype=dtype, device=device)
    dtype = dtype or target_model.dtype
    device = device or target_model.device
    tensors = read_draft_tensors(path)
    names = set(tensors)
    kind = detect_kind(names, raw)
    cfg = parse_draft_config(raw, kind, target_cfg, names)
    source = f"draft checkpoint {os.fspath(path)} ({kind})"
    try:
        check_head_shapes(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, target_cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    tensors = _module_names(tensors, cfg)
    tensors.pop("embed_tokens.weight", None)  # the target's is used (shape checked above)
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)

    with torch.device("meta"):
        draft = EagleDraft(cfg, target_model, dtype=dtype, max_positions=max_positions)
    draft.to_empty(device=device)
    draft.rotary_emb.rebuild()
    if kind != EAGLE1 and "lm_head.weight" not in tensors:
        if cfg.draft_vocab_size != target_cfg.vocab_size:
            raise ValueError(f"{source} does not match the model: missing tensors: lm_head.weight")
        # A full-vocabulary EAGLE-3 head without its own lm_head uses the target's (as SGLang).
        draft.lm_head = None
    load_named_tensors(draft, tensors.items(), ignore=_IGNORED, source=source)
    if kind != EAGLE1:
        draft.d2t = _vocab_map(d2t, t2d, cfg, source, device)
    return draft.eval()


def _module_names(tensors: dict[str, torch.Tensor], cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the module's names: an EAGLE-3 layer saved as `layers.0.*`
    (speculators, ModelOpt) is the module's `midlayer.*`."""
    if cfg.kind == EAGLE1 or cfg.layer_prefix == "midlayer.":
        return tensors
    p = cfg.layer_prefix
    return {("midlayer." + k[len(p):] if k.startswith(p) else k): v for k, v in tensors.items()}


def _vocab_map(
    d2t: torch.Tensor | None,
    t2d: torch.Tensor | None,
    cfg: DraftConfig,
    source: str,
    device: torch.device | str,
) -> torch.Tensor | None:
    """Validated d2t offsets (int64 [Vd]); None when the draft vocabulary is the target's."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if vd != v:
            raise ValueError(
                f"{source} does not match the model: missing tensors: d2t "
                f"(draft_vocab_size {vd} < vocab_size {v} needs the draft-to-target map)"
            )
        return None
    try:
        target_ids = check_d2t(d2t, cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if t2d is not None:
        expected = torch.zeros(v, dtype=torch.bool)
        expected[target_ids] = True
        if tuple(t2d.shape) != (v,) or not torch.equal(t2d.bool(), expected):
            raise ValueError(f"{source}: t2d does not agree with d2t")
    if vd == v and bool((d2t == 0).all()):
        return None
    return d2t.long().to(device)
