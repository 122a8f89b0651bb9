"""Test harness: runs train_grpo.main / train_ppo.main / train_agent.main (also under torchrun) with instruments the
tests need, injected through main's reward_fn argument and by wrapping the script module's ``resumable_batches``
and ``save_checkpoint``.

    python tests/support/run_patched.py {grpo|ppo|agent} [harness flags] -- [script flags]

Harness flags:
    --trace_dir DIR        per rank: the dataset indices of every step's prompts (indices_rank{r}.jsonl) and,
                           at every checkpoint, a sha256 digest of the policy (and critic) (digest_rank{r}.txt)
    --binary_text_reward   as --text_reward, but 0 or 1 (GRPO: some groups of equal rewards)
    --text_reward          replace the chapter's rewards (the agent's) with a fixed function of the answer text
                           (of the model's turns), so that a random tiny model gets unequal rewards and its weights
                           really change
    --dump_weights         with --trace_dir: at every checkpoint, the whole fp32 state dict of the policy (and critic)
                           as weights_step{N}.pt in the trace folder, written by rank 0 (gathered under --fsdp 1)
    --fail_on_rank1_before_step N   rank 1 raises a RuntimeError when the loop asks for step N's batch
    --kill_after_save N    SIGKILL this process right after the checkpoint of step N is written
    --kill_during_save N   SIGKILL this process in the middle of writing the resume file of step N
    --kill_before_step N   SIGKILL this process when the loop asks for step N's batch (step N-1 logged and done)
"""

import argparse
import hashlib
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from tests.support.weights_digest import parameter_digest
from trainer.infra.fsdp import full_state_dict
from trainer import train_agent, train_grpo, train_ppo


def text_rewards(prompts, responses, answers, reward_model, answer_reward_weight):
    """Reward in [0, 1) from the sha256 of the answer text (same keys as calculate_rewards)."""
    values = [int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) / 16**8 for r in responses]
    rewards = torch.tensor(values, dtype=torch.float32)
    zeros = torch.zeros_like(rewards)
    return {"rewards": rewards, "rule_rewards": rewards.clone(), "reward_model_scores": zeros, "answer_rewards": zeros}


def binary_text_rewards(prompts, responses, answers, reward_model, answer_reward_weight):
    """Reward 0 or 1 from the sha256 of the answer text (same keys as calculate_rewards): on a random tiny model some
    groups of answers get equal rewards, as DAPO's dynamic sampling needs to draw more prompts."""
    parts = text_rewards(prompts, responses, answers, reward_model, answer_reward_weight)
    rewards = (parts["rewards"] >= 0.5).float()
    return {**parts, "rewards": rewards, "rule_rewards": rewards.clone()}


def agent_text_rewards(messages, rollout, gts, reward_model, gt_weight):
    """Rewards in [0, 1) from the sha256 of the turns (unequal on a random tiny model), with the agent's keys (same
    arguments and keys as trainer.agent.rewards.calculate_agent_rewards)."""
    values = [int(hashlib.sha256("|".join(texts).encode()).hexdigest()[:8], 16) / 16**8 for texts in rollout.turn_texts]
    rewards = torch.tensor(values, dtype=torch.float32)  # [N]
    parts = {
        key: torch.zeros_like(rewards)
        for key in (
            "rule_rewards",
            "reward_model_scores",
            "answer_rewards",
            "call_rewards",
            "tag_penalties",
            "unfinished_penalties",
            "repetition_penalties",
            "accuracy",
            "called",
        )
    }
    return dict(parts, rewards=rewards)


SCRIPTS = {
    "grpo": (train_grpo, text_rewards),
    "ppo": (train_ppo, text_rewards),
    "agent": (train_agent, agent_text_rewards),
}  # name -> (module, its --text_reward function)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("script", choices=sorted(SCRIPTS))
    parser.add_argument("--trace_dir", default="")
    parser.add_argument("--text_reward", action="store_true")
    parser.add_argument("--binary_text_reward", action="store_true")
    parser.add_argument("--dump_weights", action="store_true")
    parser.add_argument("--fail_on_rank1_before_step", type=int, default=0)
    parser.add_argument("--kill_after_save", type=int, default=0)
    parser.add_argument("--kill_during_save", type=int, default=0)
    parser.add_argument("--kill_before_step", type=int, default=0)
    harness_argv, script_argv = sys.argv[1:], []
    if "--" in harness_argv:
        i = harness_argv.index("--")
        harness_argv, script_argv = harness_argv[:i], harness_argv[i + 1 :]
    opts = parser.parse_args(harness_argv)
    module, script_text_rewards = SCRIPTS[opts.script]
    real_torch_save, real_batches, real_save_checkpoint = torch.save, module.resumable_batches, module.save_checkpoint

    def rank():
        return dist.get_rank() if dist.is_initialized() else 0

    def killing_torch_save(obj, path):
        if "_resume.pth" not in str(path):  # the weights files are written as usual
            return real_torch_save(obj, path)
        with open(path, "wb") as f:  # part of the resume file, then the process dies as if killed mid-write
            f.write(b"\0" * 4096)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def traced_batches(*args, **kwargs):
        for step, position, batch in real_batches(*args, **kwargs):
            if step == opts.kill_before_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == opts.fail_on_rank1_before_step and rank() == 1:
                raise RuntimeError(f"rank 1 fails on purpose before step {step}")
            if opts.trace_dir:
                with open(os.path.join(opts.trace_dir, f"indices_rank{rank()}.jsonl"), "a") as f:
                    f.write(json.dumps(batch["index"].tolist()) + "\n")
            yield step, position, batch

    def instrumented_save_checkpoint(args, script, lm_config, objects, progress, weights):
        step = progress["step"]
        if opts.kill_during_save and step == opts.kill_during_save:
            torch.save = killing_torch_save  # torch's own function: the checkpoint's atomic write calls it
        path = real_save_checkpoint(args, script, lm_config, objects, progress, weights)
        torch.save = real_torch_save
        if opts.trace_dir:
            digests = {name: parameter_digest(objects[name]) for name in ("model", "critic") if name in objects}
            with open(os.path.join(opts.trace_dir, f"digest_rank{rank()}.txt"), "a") as f:
                f.write(json.dumps({"step": step, **digests}) + "\n")
        if opts.trace_dir and opts.dump_weights:
            whole = {name: full_state_dict(objects[name]) for name in ("model", "critic") if name in objects}
            if rank() == 0:
                torch.save(whole, os.path.join(opts.trace_dir, f"weights_step{step}.pt"))
        if opts.kill_after_save and step == opts.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    if opts.trace_dir:
        os.makedirs(opts.trace_dir, exist_ok=True)
    module.resumable_batches, module.save_checkpoint = traced_batches, instrumented_save_checkpoint
    if opts.binary_text_reward:
        module.main(script_argv, reward_fn=binary_text_rewards)
    elif opts.text_reward:
        module.main(script_argv, reward_fn=script_text_rewards)
    else:
        module.main(script_argv)  # the script's own rewards


if __name__ == "__main__":
    main()
