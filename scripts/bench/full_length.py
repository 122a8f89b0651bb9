"""Full-length answers for the benchmarks: a training script whose rollouts sample every answer to --max_gen_len.

The benchmarks time the same work for every contestant: TRL's with ``min_new_tokens``, SGLang's with
``ignore_eos``, ours with ``full_length_answers()``, which gives ``MiniMindForCausalLM.generate`` an EOS id that no
token has (-1, ``NEVER_SAMPLED``). Rows then sample past the tokenizer's EOS; the rollout's completion mask, the
rewarded text and the loss still end at the first EOS (they read the tokenizer's EOS id). Nothing else changes.

    python scripts/bench/full_length.py {grpo|ppo} [flags of trainer/train_{grpo|ppo}.py]
"""

import contextlib
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from model.model_minimind import MiniMindForCausalLM

NEVER_SAMPLED = -1  # an EOS id no sampled token equals (token ids are >= 0)


@contextlib.contextmanager
def full_length_answers():
    """Within the block, ``MiniMindForCausalLM.generate`` stops at ``NEVER_SAMPLED`` instead of the EOS id it is
    given: every row samples ``max_new_tokens`` tokens. The method is restored on leaving the block."""
    generate = MiniMindForCausalLM.generate

    def full_length_generate(self, *args, **kwargs):
        return generate(self, *args, **dict(kwargs, eos_token_id=NEVER_SAMPLED))

    MiniMindForCausalLM.generate = full_length_generate
    try:
        yield
    finally:
        MiniMindForCausalLM.generate = generate


def main(argv=None):
    """Run ``trainer/train_{script}.py``'s ``main`` with full-length answers; argv: the script name, then its flags."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("grpo", "ppo"):
        sys.exit("usage: python scripts/bench/full_length.py {grpo|ppo} [flags of trainer/train_{grpo|ppo}.py]")
    module = importlib.import_module(f"trainer.train_{argv[0]}")
    with full_length_answers():
        module.main(argv[1:])


if __name__ == "__main__":
    main()
