"""Agent RL for a MiniMind policy: multi-turn tool use trained with the chapter's GRPO / CISPO (chapter 8.5).

One step, in the order of ``train_grpo.py``: the policy answers each prompt G times, calling tools over up to
``--max_turns`` turns (``agent/rollout.py``: the tools' replies sit in the sequence with mask 0, only the model's own
tokens are trained); rewards (upstream MiniMind's agent reward, ``agent/rewards.py``); reference log-probs on the
model's tokens; group advantages (8.5.1; the other estimators in ``advantage_estimators.py``); the CISPO / GRPO loss
with beta * k3 KL (8.5.2, 8.6; the family in ``grpo_family.py``). ``main`` builds what the step uses in numbered
blocks, then runs the loop in ``train_grpo.py``'s order: loss -> backward -> clip and step
(``infra/optimizer.OptimizerStep``). Source: upstream MiniMind's ``trainer/train_agent.py`` (jingyaogong/minimind);
the tools and their bounds are ``agent/tools.py``. Prompts are cut from the left to ``--max_total_len -
--max_gen_len`` tokens.
``--rollout_engine sglang``: an SGLang server generates every turn, the policy pushed to it after each update
(chapter 8.2, ``rollout_engine.SGLangRolloutEngine``); old log-probs as ``--sglang_logprobs`` says.

Run (upstream-format rows: conversations whose system turn carries ``tools``, and ``gt``):
    python trainer/train_agent.py
    python trainer/train_agent.py --data_path dataset/agent_rl.jsonl --reward_model_path none --debug_mode 1
    python trainer/train_agent.py --rollout_engine sglang --sglang_url http://127.0.0.1:30000
"""

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import torch
from torch.utils.data import DataLoader

from dataset.agent_dataset import AGENT_TEST_DATA, AGENT_TRAIN_DATA, AgentRLDataset, collate_agent_rows
from dataset.lm_dataset import ResumableBatchSampler, count_total_steps, resumable_batches
from trainer.advantage_estimators import (
    add_estimator_args,
    build_advantage_config,
    check_estimator_args,
    compute_advantages,
    loss_beta,
)
from trainer.agent.rewards import calculate_agent_rewards
from trainer.agent.rollout import agent_rollout, ended_with_eos, template_kwargs
from trainer.agent.tools import conversation_tools
from trainer.evaluation import build_agent_evaluator, evaluate_if_due, evaluation_due
from trainer.grpo_family import (
    LOSS_TYPES,
    TOKEN_SUM_LOSS_TYPES,
    add_family_args,
    build_loss_config,
    check_family_args,
    family_loss,
    frac_reward_zero_std,
    rollout_correction,
    update_metrics,
)
from trainer.infra.checkpoints import (
    checkpoint_progress,
    claim_save_dir,
    resume_command,
    save_checkpoint,
    start_or_resume,
)
from trainer.infra.distributed import (
    Logger,
    all_ranks_mean,
    compile_for_training,
    init_distributed_mode,
    mean_over_ranks,
    rank_and_world_size,
    setup_seed,
    shutdown_distributed,
    wrap_ddp,
)
from trainer.infra.dtypes import autocast_context, resolve_train_dtype, reward_model_dtype
from trainer.infra.errors import InputError, run_script
from trainer.infra.flags import (
    AT_LEAST_1,
    AT_LEAST_2,
    NON_NEGATIVE,
    add_common_rl_args,
    check_common_rl_args,
    flag_groups,
    rollout_engine_kwargs,
    same_file,
)
from trainer.infra.metrics import (
    StepLog,
    gpu_memory_metrics,
    open_metrics,
    print_conversations,
)
from trainer.step_metrics import agent_log_line, agent_metrics
from trainer.infra.fsdp import gathered_weights, load_on_rank0, shard_roles
from trainer.infra.lora import with_adapters
from trainer.infra.optimizer import OptimizerStep, build_cosine_scheduler, build_policy_optimizer
from trainer.infra.stopping import BadStepGuard, StopSignal, finish_run
from trainer.infra.weights import config_from_args, start_weight_path, frozen_copy, load_policy, load_tokenizer
from trainer.rollout_engine import RolloutRoles, create_rollout_engine
from trainer.speed.chunked_logps import log_prob_forward
from trainer.trainer_utils import load_reward_model


# ----------------------------------------------------------------------------- flags
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind agent RL (multi-turn tool use, GRPO / CISPO)")
    groups = flag_groups(parser)  # --help's groups: the chapter's flags first (infra/flags.py)
    add_common_rl_args(groups)
    rollout = groups["rollout"]
    rollout.add_argument(
        "--num_generations", type=int, default=4, action=AT_LEAST_2, help="G, conversations sampled per prompt"
    )
    rollout.add_argument(
        "--max_turns", type=int, default=3, action=AT_LEAST_1, help="model turns per conversation (upstream's 3)"
    )
    rollout.add_argument(
        "--max_total_len",
        type=int,
        default=1024,
        help="prompt + every turn and tool reply, in tokens (prompts cut from the left to "
        "max_total_len - max_gen_len; --max_gen_len is per turn)",
    )
    algorithm = groups["algorithm"]
    algorithm.add_argument(
        "--loss_type",
        default="cispo",
        help=f"one of {', '.join(LOSS_TYPES)}: the chapter's cispo (default) and grpo, then the family",
    )
    algorithm.add_argument("--epsilon", type=float, default=None, help="clipped family: lower clip 1 - epsilon (0.2)")
    algorithm.add_argument(
        "--epsilon_high",
        type=float,
        default=None,
        help="cispo: the clamp of the ratio weight (5.0); clipped family: upper clip 1 + epsilon_high",
    )
    algorithm.add_argument(
        "--num_iterations", type=int, default=1, action=AT_LEAST_1, help="mu: updates on each rollout"
    )
    groups["kl"].add_argument(
        "--beta",
        type=float,
        default=0.1,
        action=NON_NEGATIVE,
        help="weight of the k3 KL to the reference (0: no reference model is built)",
    )
    add_family_args(groups["family"])  # the loss members after the chapter (grpo_family.py)
    add_estimator_args(groups["family"])  # --advantage_estimator, --kl_placement (advantage_estimators.py)
    groups["memory"].add_argument(
        "--accumulation_steps",
        type=int,
        default=1,
        action=AT_LEAST_1,
        help="steps (rollouts) whose gradients make one optimizer step",
    )
    groups["run"].add_argument("--save_weight", default="agent", help="name of the saved weights ({name}_{hidden}.pth)")
    # the bundled task's sizes: a prompt with the calculator's schema is ~610 tokens, a call ~95, its reply ~70;
    # the start is the copy-trained out/agent_copy_256.pth; the reward is correctness and valid calls (the reward
    # model off: its score on an answer without a call can out-earn a valid call, docs/departures.md); steps and
    # learning rate were chosen on agent_rl_val, and the run reports agent_rl_test (docs/agent.md)
    parser.set_defaults(
        data_path=AGENT_TRAIN_DATA,
        from_weight="agent_copy",
        reward_model_path="none",
        thinking_ratio=0.0,
        answer_reward_weight=2.5,
        max_gen_len=128,
        max_steps=60,
        eval_interval=60,
    )
    args = parser.parse_args(argv)
    if args.micro_batch_size:
        parser.error(
            f"--micro_batch_size {args.micro_batch_size}: train_agent.py runs its update on the whole batch (micro-"
            f"batches are train_grpo.py's and train_ppo.py's); lower --batch_size or --num_generations, or turn on "
            f"--gradient_checkpointing 1 and --logprob_chunk_size"
        )
    if args.eval_data_path is None and same_file(args.data_path, AGENT_TRAIN_DATA):
        args.eval_data_path = AGENT_TEST_DATA  # the bundled task's test split (settings chosen on AGENT_VAL_DATA)
    check_common_rl_args(parser, args)
    if args.max_total_len <= args.max_gen_len:
        parser.error(f"--max_total_len must be > --max_gen_len ({args.max_gen_len}), got {args.max_total_len}")
    if args.top_p != 1.0 or args.top_k:
        parser.error(
            "train_agent.py samples every turn from the whole distribution (the loss's log-probs are over "
            "it): use --top_p 1.0 and --top_k 0"
        )
    if args.num_iterations > 1 and args.accumulation_steps > 1:
        parser.error("--num_iterations > 1 updates once per iteration: use it with --accumulation_steps 1")
    check_family_args(parser, args)
    check_estimator_args(parser, args)
    return args


# ----------------------------------------------------------------------------- one step
@dataclass
class AgentRolloutBatch:
    """What ``agent_step_rollout`` hands to the updates: B prompts x G conversations and what the loss needs."""

    rollout: object  # agent.rollout.AgentRolloutResult: ids, masks, old log-probs, turns, call counts
    completion_mask: torch.Tensor  # [B*G, R] 0/1, the model's own tokens (the loss's)
    advantages: torch.Tensor  # [B*G] fp32 (8.5.1), or [B*G, R] for --advantage_estimator reinforce_pp
    ref_per_token_logps: Optional[torch.Tensor]  # [B*G, R] fp32 (8.6), None with --beta 0
    rewards: torch.Tensor  # [B*G] fp32
    reward_parts: dict  # the reward function's parts, each [B*G]
    num_items_in_batch: float  # model tokens of every process's batch / processes (dapo's normaliser)
    metrics: dict  # the rollout's own: calls, turns, cuts, groups of equal rewards
    importance_sampling_ratio: Optional[torch.Tensor] = None  # [B*G, R] or [B*G, 1], --rollout_correction's weights


@torch.no_grad()
def agent_step_rollout(batch, model, roles, args, autocast):
    """Steps 1-4 of an agent RL step: multi-turn rollout (``agent_rollout``), rewards, reference log-probs on the
    rollout's tokens (8.6), advantages (8.5.1). ``roles``: a ``RolloutRoles`` whose ``reward_fn`` is
    ``calculate_agent_rewards`` or one with its arguments and keys, ``ref_model`` None with --beta 0, and
    ``rollout_engine`` the ``SGLangRolloutEngine`` of ``--rollout_engine sglang`` (None: ``model``'s own generate).
    Returns an ``AgentRolloutBatch`` of B*G rows."""
    G, tokenizer, ref_model = args.num_generations, roles.tokenizer, roles.ref_model
    # 1. rollout: every conversation of the batch advances turn by turn; tool replies have mask 0
    with autocast:
        rollout = agent_rollout(
            model,
            tokenizer,
            batch["messages"],
            G,
            max_new_tokens=args.max_gen_len,
            max_total_len=args.max_total_len,
            temperature=args.temperature,
            max_turns=args.max_turns,
            chat_template_kwargs=template_kwargs(batch["open_thinking"]),
            server=roles.rollout_engine,
        )
    device = rollout.completion_ids.device
    completion_mask = rollout.completion_mask  # [B*G, R]
    if args.mask_truncated_completions:  # DAPO: a last turn cut at --max_gen_len teaches nothing about its end
        completion_mask = completion_mask * ended_with_eos(rollout, tokenizer.eos_token_id).unsqueeze(1)

    # 2. rewards
    messages = [m for m in batch["messages"] for _ in range(G)]
    gts = [gt for gt in batch["gt"] for _ in range(G)]
    reward_parts = roles.reward_fn(messages, rollout, gts, roles.reward_model, args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B*G]

    # 3. reference log-probs of the whole conversation, read on the model's tokens by the loss's mask
    ref_per_token_logps = None
    if ref_model is not None:
        with autocast:  # --logprob_chunk_size: the chapter's forward with its logits in chunks
            ref_per_token_logps = log_prob_forward(args.logprob_chunk_size)(
                ref_model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask, args.temperature
            ).per_token_logps

    # 4. advantages: the group's (8.5.1), or --advantage_estimator's (advantage_estimators.py; REINFORCE++'s returns
    #    carry across the tools' replies, whose mask is 0)
    advantage_config = build_advantage_config(args)
    advantages, kl_rewards = compute_advantages(
        rewards, completion_mask, advantage_config, rollout.old_per_token_logps, ref_per_token_logps
    )  # [B*G] or [B*G, R]

    importance_sampling_ratio, mismatch_metrics = rollout_correction(  # grpo_family.py: [B*G, R] or [B*G, 1] or None
        rollout.old_per_token_logps,
        rollout.sampling_per_token_logps,
        completion_mask,
        args.rollout_correction,
        args.rollout_correction_cap,
    )  # the rollout correction (beyond the chapter): trainer against server
    calls = rollout.num_tool_calls.sum().item()
    metrics = {
        "tool_call_share": (rollout.num_tool_calls > 0).float().mean().item(),
        "valid_call_share": rollout.num_valid_calls.sum().item() / calls if calls else 0.0,
        "turns": rollout.num_turns.float().mean().item(),
        "unfinished_share": rollout.unfinished.float().mean().item(),
        "observation_len": (rollout.attention_mask[:, -completion_mask.size(1) :] - rollout.completion_mask)
        .sum(dim=1)
        .float()
        .mean()
        .item(),  # tool replies and template tokens
        **{key: float(value) for key, value in rollout.metrics.items()},
        "frac_reward_zero_std": frac_reward_zero_std(rewards, G),
        **({"kl_reward": kl_rewards.mean().item()} if advantage_config.kl_placement == "reward" else {}),
        **mismatch_metrics,
    }
    return AgentRolloutBatch(
        rollout=rollout,
        completion_mask=completion_mask,
        advantages=advantages,
        ref_per_token_logps=ref_per_token_logps,
        rewards=rewards,
        reward_parts=reward_parts,
        num_items_in_batch=all_ranks_mean(completion_mask.sum().double(), device),
        metrics=metrics,
        importance_sampling_ratio=importance_sampling_ratio,
    )


def agent_policy_loss(model, rollout_batch, loss_config, args, autocast):
    """Step 5, once per update: the policy's log-probs of the whole conversations through ``model`` (the DDP
    wrapper when distributed) and ``family_loss`` on the model's tokens (the mask) with the k3 KL penalty.
    Returns (loss to backpropagate, metrics of this update); the loop divides the loss by its window."""
    rollout, completion_mask = rollout_batch.rollout, rollout_batch.completion_mask
    old_per_token_logps = rollout.old_per_token_logps.detach()  # [B*G, R], 0 on tool replies
    with autocast:
        per_token_logps, aux_loss, entropies = log_prob_forward(args.logprob_chunk_size)(
            model,
            rollout.output_ids,
            rollout.completion_ids.size(1),
            rollout.attention_mask,
            args.temperature,
            compute_entropy=True,
        )  # [B*G, R] each
    token_sum = loss_config.loss_type in TOKEN_SUM_LOSS_TYPES  # the window's normaliser waits for its end
    policy_loss, per_token_kl, ratio = family_loss(
        per_token_logps,
        old_per_token_logps,
        rollout_batch.ref_per_token_logps,
        rollout_batch.advantages,
        completion_mask,
        loss_config,
        1.0 if token_sum else None,
        rollout_batch.importance_sampling_ratio,
    )
    logged_policy_loss = policy_loss.item() / (rollout_batch.num_items_in_batch if token_sum else 1.0)
    metrics = {"policy_loss": logged_policy_loss, "aux_loss": float(aux_loss)}
    metrics.update(
        update_metrics(
            per_token_logps.detach(), old_per_token_logps, per_token_kl, ratio, entropies, rollout_batch, loss_config
        )
    )
    return policy_loss + aux_loss, metrics


def main(argv=None, reward_fn=calculate_agent_rewards):
    """Agent RL: the roles of chapter 8.1 without a critic, then multi-turn rollout -> rewards -> group advantage
    -> loss -> update, step after step (8.5).
    ``reward_fn``: your own rewards, with the arguments and result of ``calculate_agent_rewards``."""
    args = parse_args(argv)

    # 1. processes, seed and dtype
    local_rank, device = init_distributed_mode(args.device, cpu_collectives=args.fsdp and args.fsdp_cpu_offload)
    rank, world_size = rank_and_world_size()
    setup_seed(args.seed)  # identical initial weights on every rank
    train_dtype = resolve_train_dtype(args.dtype, device)
    autocast = autocast_context(device, train_dtype)
    loss_config = build_loss_config(args)
    loss_config = replace(loss_config, beta=loss_beta(build_advantage_config(args)))  # 0: the KL is in the rewards

    # 2. tokenizer, rows (checked: tools, gt, schemas) and their loader
    start_weight = start_weight_path(args)  # the .pth the tokenizer is checked against (None: random, a folder)
    tokenizer = load_tokenizer(args.tokenizer_path, start_weight, args.tokenizer_path_named)
    train_ds = AgentRLDataset(args.data_path, tokenizer, args.thinking_ratio, args.seed, check_tools=conversation_tools)
    if len(train_ds) < args.batch_size * world_size:
        raise InputError(
            f"--data_path {args.data_path}: found {len(train_ds)} rows, need at least "
            f"{args.batch_size * world_size} (--batch_size x processes) for one full batch"
        )
    batch_sampler = ResumableBatchSampler(train_ds, args.batch_size, world_size, rank, args.seed)
    loader = DataLoader(
        train_ds,
        batch_sampler=batch_sampler,
        num_workers=args.num_workers,
        collate_fn=collate_agent_rows,
        generator=torch.Generator().manual_seed(args.seed),
    )
    total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
    evaluator = build_agent_evaluator(args, tokenizer, device)  # its rows checked before any model is built
    run_lock = claim_save_dir(args, "agent", total_steps)

    # 3. the roles (8.1): the policy is trained; the reference and the reward model stay frozen
    lm_config = config_from_args(args)  # the architecture flags, or the model folder's config.json
    model = load_on_rank0(  # pi_theta (--fsdp 1: read on rank 0 alone, the other ranks' copy empty until sharded)
        lambda: load_policy(lm_config, args.from_weight, args.save_dir, tokenizer, device), lm_config, args.fsdp
    )
    ref_model = frozen_copy(model, args.ref_dtype) if args.beta and not args.lora_rank else None  # --ref_dtype
    if args.gradient_checkpointing:  # recompute each block in the backward (transformers' convention, non-reentrant)
        model.activation_checkpointing_enable({"use_reentrant": False})
    model, ref_model = with_adapters(model, ref_model, args, args.beta > 0)  # --lora_rank: pi_ref = adapters off
    model, ref_model = shard_roles(args, device, train_dtype, model, ref_model)  # --fsdp 1: 1/N of each per rank
    reward_model = load_reward_model(args, device, reward_model_dtype(args.reward_dtype, args.reward_device or device))
    setup_seed(args.seed + rank)  # from here on every rank samples its own conversations
    Logger(
        f"agent RL: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(train_ds)} prompts, "
        f"world size {world_size}, device {device}, dtype {train_dtype}"
    )

    # 4. optimizer
    optimizer = build_policy_optimizer(
        model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate, args.optimizer
    )
    ddp_model = compile_for_training(wrap_ddp(model, device, local_rank), args.use_compile)

    # 5. resume (--from_resume 1): weights, optimizer, data position, random state; the schedule at that update
    trained = {"model": model, "optimizer": optimizer}
    progress, engine_state = start_or_resume(args, "agent", trained, len(loader), device, rank, world_size)
    num_updates = -(-total_steps // args.accumulation_steps) * args.num_iterations
    scheduler = build_cosine_scheduler(optimizer, num_updates, progress["lr_schedule_step"])

    # 6. --rollout_engine sglang (8.2): the server that generates every turn, made after the resume (it is pushed
    #    the resumed policy); torch: the policy's own generate
    server = None
    if args.rollout_engine == "sglang":
        server = create_rollout_engine(args.rollout_engine, model, tokenizer, **rollout_engine_kwargs(args))
        server.load_resume_state(engine_state)
        trained["rollout_engine"] = server  # its push cadence is saved with the checkpoints
    roles = RolloutRoles(server, tokenizer, reward_fn, reward_model, ref_model)  # what the rollout uses

    # 7. the held-out evaluation, the stop requests, the update with its NaN guard (infra/optimizer.OptimizerStep)
    stop_signal = StopSignal()
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    optimizer_step = OptimizerStep(  # clip and step (infra/optimizer.py): the update after every backward
        [ddp_model],
        [optimizer],
        args.grad_clip,
        device,
        args.accumulation_steps,
        total_steps,
        [scheduler],
        guard,
        token_sum=loss_config.loss_type in TOKEN_SUM_LOSS_TYPES,
        state=progress,
    )
    at_start = not progress["step"] and evaluation_due(evaluator, 0, total_steps, args.eval_interval)
    with gathered_weights(model, args.fsdp_reshard_after_forward, at_start):  # --fsdp 1: whole, once per evaluation
        start_metrics = (
            {}
            if progress["step"]
            else evaluate_if_due(evaluator, model, 0, total_steps, args.eval_interval, lambda: stop_signal.received)
        )

    # 8. metrics: metrics.jsonl (+ wandb) and the log line
    run_dir, writer = open_metrics(args, progress)
    Logger(
        f"agent RL: {total_steps} steps, {args.batch_size} prompts x {args.num_generations} conversations of up "
        f"to {args.max_turns} turns per step, loss {args.loss_type}, metrics in {run_dir}"
    )
    if start_metrics:
        writer.log({"step": 0, **start_metrics})
    step_log = StepLog(writer, total_steps, args.log_interval, agent_log_line, start_step=progress["step"])

    # 9. the loop
    ddp_model.train()
    step, stop = progress["step"], stop_signal.requested(device)
    batches = [] if stop else resumable_batches(loader, batch_sampler, progress, args.epochs, total_steps)
    for step, position, batch in batches:
        learning_rate = float(optimizer.param_groups[0]["lr"])
        with gathered_weights(
            model, args.fsdp_reshard_after_forward, frozen=[ref_model]
        ):  # --fsdp 1: the whole policy to sample from
            rollout_batch = agent_step_rollout(batch, ddp_model, roles, args, autocast)  # steps 1-4
        if args.debug_mode and step % args.debug_interval == 0:
            print_conversations(step, rollout_batch, tokenizer, args.num_generations)
        window = optimizer_step.begin_step(step, rollout_batch.num_items_in_batch)  # its accumulation window's size
        updates = []  # the metrics of each update on this rollout
        for _ in range(args.num_iterations):  # mu updates on one rollout
            loss, this_update = agent_policy_loss(ddp_model, rollout_batch, loss_config, args, autocast)  # step 5
            (loss / window).backward()
            this_update.update(optimizer_step.clip_and_step(step, rewards=rollout_batch.rewards, loss=loss))
            updates.append(this_update)
        if optimizer_step.update_due(step) and server is not None:
            server.update_policy(model)  # the next turns are generated by the updated policy
        metrics = mean_over_ranks(agent_metrics(rollout_batch, updates), device)
        metrics.update(gpu_memory_metrics(device))
        due = evaluation_due(evaluator, step, total_steps, args.eval_interval)
        with gathered_weights(model, args.fsdp_reshard_after_forward, due):  # --fsdp 1: whole, once per evaluation
            metrics.update(
                evaluate_if_due(evaluator, model, step, total_steps, args.eval_interval, lambda: stop_signal.received)
            )
        step_log.write(step, position["epoch"], metrics, {"learning_rate": learning_rate}, batch["index"].tolist())
        stop = stop_signal.requested(device)
        if step % args.save_interval == 0 or step == total_steps or stop:
            saved = checkpoint_progress(step, total_steps, position, scheduler, run_dir, writer, guard, optimizer_step)
            save_checkpoint(args, "agent", lm_config, trained, saved, {args.save_weight: model})
        if stop:
            break

    finish_run(
        stop_signal, step if stop else None, resume_command(__file__, argv, world_size), evaluator, writer, run_lock
    )
    del ddp_model, optimizer_step  # free the DDP wrapper (it holds one too) while the process group is alive
    shutdown_distributed()


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
