"""Test harness: runs train_grpo.main / train_ppo.main (also under torchrun) with instruments the tests need.

    python tests/run_patched.py {grpo|ppo} [harness flags] -- [script flags]

Harness flags:
    --trace_dir DIR        per rank: the dataset indices of every step's prompts (indices_rank{r}.jsonl) and,
                           at every checkpoint, a sha256 digest of the policy (and critic) (digest_rank{r}.txt)
    --text_reward          replace the chapter's rewards with a fixed function of the answer text, so that a
                           random tiny model gets unequal rewards and its weights really change
    --kill_after_save N    SIGKILL this process right after the checkpoint of step N is written
    --kill_during_save N   SIGKILL this process in the middle of writing the resume file of step N
"""
import argparse
import hashlib
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer import train_grpo, train_ppo, trainer_utils  # noqa: E402


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def text_rewards(prompts, responses, answers, reward_model, answer_reward_weight):
    """Reward in [0, 1) from the sha256 of the answer text (same keys as calculate_rewards)."""
    values = [int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) / 16 ** 8 for r in responses]
    rewards = torch.tensor(values, dtype=torch.float32)
    zeros = torch.zeros_like(rewards)
    return {"rewards": rewards, "rule_rewards": rewards.clone(), "reward_model_scores": zeros,
            "answer_rewards": zeros}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("script", choices=["grpo", "ppo"])
    parser.add_argument("--trace_dir", default="")
    parser.add_argument("--text_reward", action="store_true")
    parser.add_argument("--kill_after_save", type=int, default=0)
    parser.add_argument("--kill_during_save", type=int, default=0)
    harness_argv, script_argv = sys.argv[1:], []
    if "--" in harness_argv:
        i = harness_argv.index("--")
        harness_argv, script_argv = harness_argv[:i], harness_argv[i + 1:]
    opts = parser.parse_args(harness_argv)
    module = train_grpo if opts.script == "grpo" else train_ppo

    if opts.text_reward:
        module.calculate_rewards = text_rewards

    if opts.trace_dir:
        os.makedirs(opts.trace_dir, exist_ok=True)
        step_fn_name = "grpo_step" if opts.script == "grpo" else "ppo_rollout"
        original_step = getattr(module, step_fn_name)

        def traced_step(batch, *args, **kwargs):
            with open(os.path.join(opts.trace_dir, f"indices_rank{rank()}.jsonl"), "a") as f:
                f.write(json.dumps(batch["index"].tolist()) + "\n")
            return original_step(batch, *args, **kwargs)

        setattr(module, step_fn_name, traced_step)

    original_save = module.save_checkpoint
    original_torch_save = trainer_utils.torch.save

    def killing_torch_save(obj, f):
        if "_resume.pth" not in f.name:  # the weights files are written as usual
            return original_torch_save(obj, f)
        f.write(b"\0" * 4096)  # part of the resume file, then the process dies as if killed mid-write
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def instrumented_save(args, script, lm_config, objects, progress, weights):
        if opts.kill_during_save and progress["step"] == opts.kill_during_save:
            trainer_utils.torch.save = killing_torch_save
        path = original_save(args, script, lm_config, objects, progress, weights)
        trainer_utils.torch.save = original_torch_save
        if opts.trace_dir:
            digests = {name: trainer_utils.parameter_digest(objects[name])
                       for name in ("model", "critic") if name in objects}
            with open(os.path.join(opts.trace_dir, f"digest_rank{rank()}.txt"), "a") as f:
                f.write(json.dumps({"step": progress["step"], **digests}) + "\n")
        if opts.kill_after_save and progress["step"] == opts.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    module.save_checkpoint = instrumented_save
    module.main(script_argv)


if __name__ == "__main__":
    main()
