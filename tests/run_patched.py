"""Test harness: runs train_grpo.main / train_ppo.main (also under torchrun) with instruments the tests need,
injected through main's reward_fn and run_class arguments.

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

import torch

from trainer import train_grpo, train_ppo, trainer_utils
from tests.weights_digest import parameter_digest
from trainer.rl_harness import RLRun


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
    real_torch_save = torch.save

    def killing_torch_save(obj, f):
        if "_resume.pth" not in f.name:  # the weights files are written as usual
            return real_torch_save(obj, f)
        f.write(b"\0" * 4096)  # part of the resume file, then the process dies as if killed mid-write
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    class InstrumentedRun(RLRun):
        """The harness with the instruments asked for: traces, and kills at a checkpoint."""

        def batches(self):
            for step, batch in super().batches():
                if opts.trace_dir:
                    with open(os.path.join(opts.trace_dir, f"indices_rank{self.rank}.jsonl"), "a") as f:
                        f.write(json.dumps(batch["index"].tolist()) + "\n")
                yield step, batch

        def save(self):
            step = self.progress["step"]
            if opts.kill_during_save and step == opts.kill_during_save:
                torch.save = killing_torch_save  # torch's own function: the harness's atomic_save calls it
            path = super().save()
            torch.save = real_torch_save
            if opts.trace_dir:
                digests = {name: parameter_digest(self.objects[name])
                           for name in ("model", "critic") if name in self.objects}
                with open(os.path.join(opts.trace_dir, f"digest_rank{self.rank}.txt"), "a") as f:
                    f.write(json.dumps({"step": step, **digests}) + "\n")
            if opts.kill_after_save and step == opts.kill_after_save:
                os.kill(os.getpid(), signal.SIGKILL)
            return path

    if opts.trace_dir:
        os.makedirs(opts.trace_dir, exist_ok=True)
    module.main(script_argv, reward_fn=text_rewards if opts.text_reward else trainer_utils.calculate_rewards,
                run_class=InstrumentedRun)


if __name__ == "__main__":
    main()
