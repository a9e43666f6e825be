"""The routed (mixture-of-experts) MLP: a router picks `num_experts_per_tok` of
`num_experts` gated MLPs per token, their outputs summed with the router's weights (plus, where
configured, a shared expert behind a sigmoid gate). ModelConfig's MoE fields say its shape;
`ModelConfig.is_sparse(layer)` says which layers have it instead of the dense MLP (or beside
it: `moe_beside_dense`, decoder_layer.py).

Parameter names are those of Hugging Face checkpoints in their per-expert layout
(mlp.gate.weight [E, H] and with `router_bias` mlp.gate.bias [E],
mlp.experts.{e}.gate_proj/up_proj/down_proj.weight and with `expert_bias` their .bias,
mlp.shared_expert.*, mlp.shared_expert_gate.weight [1, H]; the router variants'
mlp.router_scale [H] and mlp.per_expert_scale [E]); expert_layout.py maps the other layouts
onto them, a family's `renamed` other names.

Router scorings (`router_scoring`): "softmax" (softmax over every expert in float32, the top
k, optionally renormalised), "topk_softmax" (the top k logits, softmax over those k in the
logits' dtype: gpt-oss; mathematically softmax-then-renormalise, rounded as the reference).
Expert activations (`expert_activation`): "gated" (act(gate) * up, the dense MLP's act),
"clamped_swiglu" (gpt-oss: gate clamped to <= limit, up to [-limit, limit], then
(up + 1) * gate * sigmoid(alpha * gate)).
"""

from __future__ import annotations

import torch
from torch import nn

from eaglebatch.model.moe_grouped import fits_capture, grouped_experts, stack_experts

ROUTER_SCORINGS = ("softmax", "topk_softmax")
EXPERT_ACTIVATIONS = ("gated", "clamped_swiglu")


def expert_rows(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many (token, slot) pairs of the step chose each expert."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def route(
    logits: torch.Tensor, top_k: int, renormalise: bool, weights_float32: bool,
    expert_scale: torch.Tensor | None = None,  # [E]
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> weights [T, k], experts int64 [T, k]
    """"softmax": softmax over the experts in float32, the top k, optionally renormalised to
    sum to 1, then each weight times its expert's `expert_scale` (in float32); the weights
    cast to the logits' dtype unless `weights_float32` (then the expert outputs are weighted in
    float32 and cast after: Mixtral's order). "topk_softmax": the top k logits, softmax over
    them in the logits' dtype (sums to 1: `renormalise` changes nothing; no expert scale)."""
    if scoring == "topk_softmax":
        if expert_scale is not None:
            raise ValueError("router_scoring topk_softmax takes no per-expert scale")
        values, experts = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=values.dtype)
        return (weights.float() if weights_float32 else weights), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale.float()[experts]
    return (weights if weights_float32 else weights.to(logits.dtype)), experts


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation of (gate, up) [N, I] each -> [N, I], in the reference's
    order: gate <= limit, up in [-limit, limit], glu = gate * sigmoid(gate * alpha),
    (up + 1) * glu."""

    def combine(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    combine.spec = ("clamped_swiglu", alpha, limit)  # what the native CPU kernel computes
    return combine


def expert_combine(cfg):
    """The (gate, up) -> inner activation of cfg's routed experts (`expert_activation`); None
    for "gated" (Expert's act(gate) * up)."""
    kind = cfg.expert_activation
    if kind == "gated":
        return None
    if kind == "clamped_swiglu":
        return clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
    raise ValueError(f"expert_activation {kind!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")


def _linear(n_in: int, n_out: int, bias: bool, **factory) -> nn.Linear:
    """nn.Linear, without its random init when built on the meta device (weights are loaded
    afterwards): a model of 128 experts in 48 layers holds ~18k expert linears, whose kaiming
    init on meta runs a Python decomposition (~3 s per build of the model)."""
    weight = torch.empty(n_out, n_in, **factory)
    if weight.device.type != "meta":
        return nn.Linear(n_in, n_out, bias=bias, **factory)
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = n_in, n_out
    linear.weight = nn.Parameter(weight)
    linear.bias = nn.Parameter(torch.empty(n_out, **factory)) if bias else None
    return linear


class Expert(nn.Module):
    """One expert: down(combine(gate(x), up(x))), combine = act(gate) * up unless given;
    with `bias`, each projection has one."""

    def __init__(self, hidden: int, inner: int, act, bias: bool = False, combine=None,
                 **factory) -> None:  # fmt: skip
        super().__init__()
        self.gate_proj = _linear(hidden, inner, bias, **factory)
        self.up_proj = _linear(hidden, inner, bias, **factory)
        self.down_proj = _linear(inner, hidden, bias, **factory)
        self.act = act
        self.combine = combine
        # the activation as the native CPU kernel names it (cpu/moe.py); None: act(gate) * up
        self.native_activation = getattr(combine, "spec", None)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [N, I] x2 -> [N, I]
        """The activation between the projections (the grouped GEMMs call it too)."""
        if self.combine is not None:
            return self.combine(gate, up)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The routed MLP of one layer, run grouped by expert; each token's sum gathers its
    experts' weighted outputs in ascending expert order from zero (deterministic, as the
    reference). Which path runs (`_routed`):
    - experts stacked (moe_grouped.py: plain float nn.Linear experts without bias on CUDA, or
      on the CPU under moe_grouped.ON_CPU): two grouped GEMMs over all experts, no host sync;
      while a CUDA graph captures only where torch's grouped kernel needs no sync (bfloat16,
      compute capability 9.x / 10.x), else the dense masked path;
    - otherwise (CPU runs: native or GGUF linears; expert biases): one call per active expert
      (`_grouped`, a host sync for the counts), the dense masked path while a graph captures."""

    def __init__(self, cfg, act, **factory) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_experts
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weights_float32 = cfg.router_weights_float32
        if cfg.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router_scoring {cfg.router_scoring!r} is not one of "
                             f"{', '.join(ROUTER_SCORINGS)}")  # fmt: skip
        self.scoring = cfg.router_scoring
        self.routing_counts = None  # a moe_counts.RoutingCounts where the run counts routing
        self.gate = nn.Linear(h, e, bias=cfg.router_bias, **factory)
        # cfg.router_input_scale: the router sees rms(x) * router_scale / sqrt(H) (rms without
        # a weight, in float32, cast back; then the two products in x's dtype)
        self.router_scale = self.per_expert_scale = None
        if cfg.router_input_scale:
            self.router_scale = nn.Parameter(torch.ones(h, **factory))
            self.eps = cfg.rms_norm_eps
        if cfg.router_expert_scale:  # each routed weight times its expert's scale
            self.per_expert_scale = nn.Parameter(torch.ones(e, **factory))
        combine = expert_combine(cfg)
        self.experts = nn.ModuleList(
            Expert(h, cfg.moe_intermediate_size, act, cfg.expert_bias, combine, **factory)
            for _ in range(e))  # fmt: skip
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(h, cfg.shared_expert_intermediate_size, act, **factory)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, **factory)
        self._stacked = stack_experts(self.experts)  # (gate_up, down) or None

    def _apply(self, fn, recurse=True):
        # every move or cast (.to(), to_empty() in from_pretrained) gives each parameter its
        # own storage: stack the experts again on their new device / dtype
        out = super()._apply(fn, recurse)
        self._stacked = stack_experts(self.experts)
        return out

    def forward(
        self, x: torch.Tensor, router_input: torch.Tensor | None = None  # [T, H] each
    ) -> torch.Tensor:  # [T, H]: the experts (and shared expert) over x
        """`router_input`: what the router scores (None: x itself)."""
        weights, experts = route(self._logits(x if router_input is None else router_input),
                                 self.top_k, self.renormalise, self.weights_float32,
                                 self.per_expert_scale, self.scoring)  # fmt: skip
        rows = None  # tokens per expert, where the host counts them anyway
        if self.routing_counts is not None:  # moe_counts.count_routing (CPU runs)
            rows = expert_rows(experts, len(self.experts))
            self.routing_counts.add(rows)
        out = self._routed(x, weights, experts, rows)
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

    def _routed(self, x, weights, experts, rows=None) -> torch.Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self._stacked is not None and not (capturing and not fits_capture(x)):
            return grouped_experts(x, weights, experts, self._stacked, self.experts[0].glu)
        if capturing:
            return self._dense(x, weights, experts)  # no host sync inside a CUDA graph
        return self._grouped(x, weights, experts, rows)

    def _grouped(self, x, weights, experts, rows=None) -> torch.Tensor:
        """`rows`: `expert_rows(experts)` where the caller has it (else counted here)."""
        flat = experts.reshape(-1)  # [T*k]: slot j of token t at t*k + j
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert
        counts = (expert_rows(experts, len(self.experts)) if rows is None else rows).tolist()
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
