"""Small distributed programs for tests/test_distributed.py, launched with torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 tests/support/dist_worker.py toy_linear OUT_DIR
    torchrun --standalone --nproc_per_node 2 tests/support/dist_worker.py ppo_one_rank_kl OUT_DIR EARLY_STOP_KL

Each rank writes OUT_DIR/rank{r}.json with what it ended with.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from trainer.rollout_engine import compute_per_token_logps
from trainer.infra.distributed import wrap_ddp
from trainer.infra.dtypes import autocast_context
from trainer.train_ppo import PPOLearners, PPORolloutBatch, ppo_update
from trainer.infra.weights import build_config
from trainer.infra.distributed import init_distributed_mode
from trainer.infra.optimizer import build_cosine_scheduler
from model.model_minimind import CriticModel, MiniMindForCausalLM


def toy_linear(local_rank, device):
    """Linear(2, 1) from [1, 1]; rank 0 sees [1, 0], rank 1 sees [0, 1]; loss = output.sum(); SGD lr 1."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp_model = wrap_ddp(model, device, local_rank)
    x = torch.tensor([[1.0, 0.0]]) if dist.get_rank() == 0 else torch.tensor([[0.0, 1.0]])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1.0)
    ddp_model(x).sum().backward()
    optimizer.step()
    return {"weight": model.weight.detach().flatten().tolist()}


def ppo_one_rank_kl(local_rank, device, early_stop_kl):
    """ppo_update where rank 0's old log-probs are 2 nats off (local approx KL 2.0) and rank 1's are exact (0.0)."""
    torch.manual_seed(0)  # same initial weights on both ranks
    config = build_config(64, 2, 0)
    actor, critic = MiniMindForCausalLM(config), CriticModel(config)
    ddp_actor, ddp_critic = wrap_ddp(actor, device, local_rank), wrap_ddp(critic, device, local_rank)
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank() + 1)
    batch, prompt_len, gen_len = 4, 6, 4
    output_ids = torch.randint(3, 400, (batch, prompt_len + gen_len), generator=generator)  # [B, P+R]
    full_mask = torch.ones_like(output_ids)  # [B, P+R]
    completion_mask = torch.ones(batch, gen_len)  # [B, R]
    with torch.no_grad():
        per_token_logps = compute_per_token_logps(actor, output_ids, gen_len, full_mask).per_token_logps  # [B, R]
    offset = 2.0 if dist.get_rank() == 0 else 0.0
    data = PPORolloutBatch(
        output_ids=output_ids,
        full_mask=full_mask,
        completion_mask=completion_mask,
        old_per_token_logps=per_token_logps + offset,
        ref_per_token_logps=per_token_logps,
        advantages=torch.randn(batch, gen_len, generator=generator),
        returns=torch.randn(batch, gen_len, generator=generator),
        old_resp_values=torch.zeros(batch, gen_len),
    )
    args = argparse.Namespace(
        ppo_update_iters=2,
        mini_batch_size=2,
        temperature=1.0,
        clip_epsilon=0.2,
        kl_coef=0.02,
        early_stop_kl=early_stop_kl,
        cliprange_value=0.2,
        vf_coef=0.5,
        minibatch_accumulation_steps=1,
        kl_placement="loss",
        grad_clip=1.0,
        logprob_chunk_size=0,
        dtype="float32",
    )
    result = ppo_update(
        data,
        PPOLearners(
            ddp_actor,
            ddp_critic,
            (actor_optimizer, critic_optimizer),
            (build_cosine_scheduler(actor_optimizer, 10), build_cosine_scheduler(critic_optimizer, 10)),
        ),
        args,
        device,
        torch.Generator().manual_seed(0),
        autocast_context(device, args.dtype),
    )
    return {"early_stop": result["early_stop"], "optimizer_steps": result["optimizer_steps"]}


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    local_rank, device = init_distributed_mode()
    if mode == "toy_linear":
        result = toy_linear(local_rank, device)
    else:
        result = ppo_one_rank_kl(local_rank, device, float(sys.argv[3]))
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
