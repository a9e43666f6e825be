"""The routed (mixture-of-experts) MLP: a router picks `num_experts_per_tok` of
`num_experts` gated MLPs per token, their outputs summed with the router's weights (plus, where
configured, a shared expert behind a sigmoid gate). ModelConfig's MoE fields say its shape;
`ModelConfig.is_sparse(layer)` says which layers have it instead of the dense MLP (or beside
it: `moe_beside_dense`, decoder_layer.py).

Parameter names are those of Hugging Face checkpoints in their per-expert layout
(mlp.gate.weight [E, H], mlp.experts.{e}.gate_proj/up_proj/down_proj.weight,
mlp.shared_expert.*, mlp.shared_expert_gate.weight [1, H]; the router variants'
mlp.router_scale [H] and mlp.per_expert_scale [E]); expert_layout.py maps the other layouts
onto them, a family's `renamed` other names.
"""

from __future__ import annotations

import torch
from torch import nn


def route(
    logits: torch.Tensor, top_k: int, renormalise: bool, weights_float32: bool,
    expert_scale: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> weights [T, k], experts int64 [T, k]
    """Softmax over the experts in float32, the top k, optionally renormalised to sum to 1,
    then each weight times its expert's `expert_scale` (in float32); the weights cast to the
    logits' dtype unless `weights_float32` (then the expert outputs are weighted in float32
    and cast after: Mixtral's order)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale.float()[experts]
    return (weights if weights_float32 else weights.to(logits.dtype)), experts


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), without biases."""

    def __init__(self, hidden: int, inner: int, act, **factory) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=False, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=False, **factory)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """The routed MLP of one layer, run grouped by expert: the step's (token, slot) pairs
    sorted by expert (stable), one call per active expert over all of its tokens, each output
    weighted and added into its tokens' rows with index_add_ in ascending expert order (each
    token's sum gathers its experts in that fixed order: deterministic, as the reference)."""

    def __init__(self, cfg, act, **factory) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_experts
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weights_float32 = cfg.router_weights_float32
        self.gate = nn.Linear(h, e, bias=False, **factory)
        # cfg.router_input_scale: the router sees rms(x) * router_scale / sqrt(H) (rms without
        # a weight, in float32, cast back; then the two products in x's dtype)
        self.router_scale = self.per_expert_scale = None
        if cfg.router_input_scale:
            self.router_scale = nn.Parameter(torch.ones(h, **factory))
            self.eps = cfg.rms_norm_eps
        if cfg.router_expert_scale:  # each routed weight times its expert's scale
            self.per_expert_scale = nn.Parameter(torch.ones(e, **factory))
        self.experts = nn.ModuleList(
            Expert(h, cfg.moe_intermediate_size, act, **factory) for _ in range(e))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(h, cfg.shared_expert_intermediate_size, act, **factory)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, **factory)

    def forward(
        self, x: torch.Tensor, router_input: torch.Tensor | None = None  # [T, H] each
    ) -> torch.Tensor:  # [T, H]: the experts (and shared expert) over x
        """`router_input`: what the router scores (None: x itself)."""
        weights, experts = route(self._logits(x if router_input is None else router_input),
                                 self.top_k, self.renormalise, self.weights_float32,
                                 self.per_expert_scale)  # fmt: skip
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._dense(x, weights, experts)  # no host sync inside a CUDA graph
        else:
            out = self._grouped(x, weights, experts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        if self.router_scale is not None:
            x32 = x.float()
            normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
            x = normed.type_as(x) * self.router_scale * x.shape[-1] ** -0.5
        return self.gate(x)

    def _grouped(self, x, weights, experts) -> torch.Tensor:
        flat = experts.reshape(-1)  # [T*k]: slot j of token t at t*k + j
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens, slot_weights = order // self.top_k, weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                y = self.experts[e](x[rows]) * slot_weights[start : start + n, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += n
        return out

    def _dense(self, x, weights, experts) -> torch.Tensor:
        """Every expert over every token, weighted by a dense [T, E] matrix (zero where not
        routed): the same sums in the same expert order, with shapes fixed for capture."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (expert(x) * dense[:, e, None]).to(out.dtype)
        return out
