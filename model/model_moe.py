"""MiniMind's mixture-of-experts feed-forward (``--use_moe 1``): top-k routing over SwiGLU experts.

Beyond the RL chapter: a dense model (the default) never builds it. ``MiniMindBlock`` picks it when
``config.use_moe``; parameter names (``gate``, ``experts.{e}.*``) are those of MiniMind's MoE checkpoints.
Shapes: N = B * T tokens, E experts, k experts per token.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MOEFeedForward(nn.Module):
    """Top-k routed mixture of SwiGLU experts with the Switch-Transformer load-balancing loss.

    aux_loss = router_aux_loss_coef * E * sum_e f_e * P_e, where f_e is the fraction of routed slots
    that picked expert e and P_e the mean router probability of e (Fedus et al. 2021, eq. 4).
    The loss of the last forward is kept in ``self.aux_loss`` (a scalar tensor). ``expert_class(config,
    intermediate_size)`` builds one expert (MiniMind's ``FeedForward``).
    """

    def __init__(self, config, expert_class):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [expert_class(config, config.moe_intermediate_size) for _ in range(config.num_experts)]
        )
        self.aux_loss = torch.zeros(())

    def forward(self, x):
        """x: [B, T, hidden] -> [B, T, hidden], each token the weighted sum of its k experts' outputs."""
        batch, seq, hidden = x.shape
        x_flat = x.reshape(-1, hidden)  # [N, hidden]
        router_probs = F.softmax(self.gate(x_flat).float(), dim=-1)  # [N, E]
        topk_weight, topk_idx = torch.topk(router_probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        y = torch.zeros_like(x_flat)  # [N, hidden]
        for expert_id, expert in enumerate(self.experts):
            token_idx, slot = (topk_idx == expert_id).nonzero(as_tuple=True)  # [n_e], [n_e]
            if token_idx.numel() == 0:
                continue
            weight = topk_weight[token_idx, slot].unsqueeze(-1).to(x.dtype)  # [n_e, 1]
            y.index_add_(0, token_idx, expert(x_flat[token_idx]) * weight)
        if self.training and self.aux_coef > 0:
            routed_fraction = F.one_hot(topk_idx, self.num_experts).float().mean(dim=(0, 1))  # [E]
            mean_prob = router_probs.mean(dim=0)  # [E]
            self.aux_loss = self.aux_coef * self.num_experts * (routed_fraction * mean_prob).sum()
        else:
            self.aux_loss = router_probs.new_zeros(())
        return y.view(batch, seq, hidden)
