"""Small distributed programs for tests/test_distributed.py, launched with torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 tests/support/dist_worker.py toy_linear OUT_DIR
    torchrun --standalone --nproc_per_node 2 tests/support/dist_worker.py ppo_one_rank_kl OUT_DIR EARLY_STOP_KL
    torchrun --standalone --nproc_per_node 2 tests/support/dist_worker.py fsdp_shards OUT_DIR

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


def fsdp_shards(local_rank, device):
    """``--fsdp 1``'s layout on a 4-layer hidden-64 MiniMind: rank 0 loads it and the other rank builds it on the meta
    device (``load_on_rank0``), both shard it and a frozen reference (``shard_model``), then one ``OptimizerStep``
    (final-norm group, clipping at 0.5 so that it clips) on a batch every rank shares. Beside it every rank trains a
    plain copy of the same weights on the same batch: the sharded run must give its gradient norm and weights.
    Returns what this rank holds of parameters, gradients, AdamW state and reference (values counted from the local
    shards), the whole counts, and the differences from the plain copy."""
    import copy

    from trainer.infra.fsdp import full_state_dict, gathered_weights, load_on_rank0, local_numel, shard_model
    from trainer.infra.optimizer import OptimizerStep, build_policy_optimizer
    from trainer.infra.weights import frozen_copy

    config = build_config(64, 4, 0)
    torch.manual_seed(0)
    plain = MiniMindForCausalLM(config)  # the same computation without sharding, on every rank
    model = load_on_rank0(lambda: copy.deepcopy(plain), config, fsdp=True)
    meta_before_sharding = next(model.parameters()).is_meta
    ref_model = frozen_copy(model)
    shard_model(model, device)
    shard_model(ref_model, device)
    optimizers = [build_policy_optimizer(m, 1e-3, 0.1, 2e-2) for m in (model, plain)]
    steps = [OptimizerStep([m], [o], 0.5, device, 1, 1) for m, o in zip((model, plain), optimizers)]
    input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, m, step in zip(("sharded", "plain"), (model, plain), steps):
        m(input_ids).logits.float().logsumexp(-1).mean().backward()
        grads[name] = local_numel(p.grad for p in m.parameters())
        grads[f"{name}_norm"] = step.clip_and_step(1)["grad_norm"]
    whole, own = full_state_dict(model), plain.state_dict()
    weight_error = max((whole[k] - own[k]).abs().max().item() for k in own) if whole else None
    forwards = 3 if dist.get_rank() == 0 else 7  # the ranks' decoding ends at different steps
    with torch.no_grad(), gathered_weights(model):
        logit_error = max(
            (model(input_ids[:, : 5 + i]).logits - plain(input_ids[:, : 5 + i]).logits).abs().max().item()
            for i in range(forwards)
        )
    with torch.no_grad(), gathered_weights(model, frozen=[ref_model]):  # as in a rollout
        ref_model(input_ids)  # the reference has no backward: the rollout's end frees its root's gathered weights
    optimizer_state = [t for state in optimizers[0].state.values() for t in state.values() if t.dim() > 0]
    return {
        "meta_before_sharding": meta_before_sharding,
        "parameters": local_numel(model.parameters()),
        "gradients": grads["sharded"],
        "optimizer_state": local_numel(optimizer_state),
        "reference": local_numel(ref_model.parameters()),  # after a forward: what it keeps between forwards
        "whole_parameters": sum(p.numel() for p in plain.parameters()),
        "whole_gradients": grads["plain"],
        "whole_optimizer_state": local_numel(t for s in optimizers[1].state.values() for t in s.values() if t.dim()),
        "grad_norm": grads["sharded_norm"],
        "plain_grad_norm": grads["plain_norm"],
        "weight_error": weight_error,
        "logit_error": logit_error,
    }


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    local_rank, device = init_distributed_mode()
    if mode == "toy_linear":
        result = toy_linear(local_rank, device)
    elif mode == "fsdp_shards":
        result = fsdp_shards(local_rank, device)
    else:
        result = ppo_one_rank_kl(local_rank, device, float(sys.argv[3]))
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
