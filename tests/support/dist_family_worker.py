"""The GRPO family's collectives on 2 real processes (gloo, CPU), for tests/test_grpo_family.py:

    torchrun --standalone --nproc_per_node 2 tests/support/dist_family_worker.py OUT_DIR

Each rank takes its own rows (``rank_data``), computes the logged means and extremes over both processes, and runs
a dapo accumulation window of two steps through DDP the way train_grpo.py's loop does; it writes OUT_DIR/rank{r}.json.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from trainer.grpo_family import LossConfig, family_loss, global_extremes, global_masked_mean
from trainer.infra.optimizer import scale_gradients
from trainer.infra.distributed import all_ranks_mean, init_distributed_mode, shutdown_distributed, wrap_ddp

LENGTHS = {(0, 0): (5, 5, 5), (0, 1): (5, 1, 0), (1, 0): (2, 1, 1), (1, 1): (5, 5, 4)}  # (rank, step) -> rows
DAPO = LossConfig(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)


def rank_data(rank, step):
    """(offsets [3, 5], old_per_token_logps [3, 5], advantages [3], completion_mask [3, 5]) of one rank's step."""
    generator = torch.Generator().manual_seed(100 + 10 * rank + step)
    offsets = torch.randn(3, 5, generator=generator)
    old = -torch.nn.functional.softplus(offsets) + 0.3 * torch.randn(3, 5, generator=generator)
    advantages = torch.tensor([1.0, -0.5, 0.8]) * (1 if step == 0 else -1)
    mask = (torch.arange(5).unsqueeze(0) < torch.tensor(LENGTHS[rank, step]).unsqueeze(1)).long()
    return offsets, old, advantages, mask


class TokenLogps(torch.nn.Module):
    """log-probs -softplus(theta + offsets): a stand-in for the policy's forward with one weight per position."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(5))

    def forward(self, offsets):
        return -torch.nn.functional.softplus(self.theta + offsets)  # [N, 5]


def main():
    out_dir = sys.argv[1]
    local_rank, device = init_distributed_mode()
    rank = dist.get_rank()
    offsets, _, _, mask = rank_data(rank, 0)
    result = {
        "mean": global_masked_mean(offsets, mask),
        "per_sequence": global_masked_mean(offsets, mask, True),
        "extremes": list(global_extremes(offsets, mask)),
    }
    model = TokenLogps()
    ddp_model = wrap_ddp(model, device, local_rank)
    window, window_num_items = 2, 0.0
    for step in range(window):  # the loop: a token sum / the window, DDP's mean, then the window's tokens
        offsets, old, advantages, mask = rank_data(rank, step)
        token_sum, _, _ = family_loss(ddp_model(offsets), old, None, advantages, mask, DAPO, 1.0)
        window_num_items += all_ranks_mean(mask.sum().double(), device)
        (token_sum / window).backward()
    scale_gradients(model.parameters(), window / window_num_items)
    result["grad"] = model.theta.grad.tolist()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del ddp_model  # before the process group goes (shutdown_distributed)
    shutdown_distributed()


if __name__ == "__main__":
    main()
