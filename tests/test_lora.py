"""--lora_rank (trainer/infra/lora.py): the reference is the base model, only the adapters and the final norm's
copy learn, the merged weights are the policy's, the flags are checked; the resume is in tests/test_resume.py."""
import copy

import pytest
import torch

from model.model_minimind import MiniMindForCausalLM
from trainer.infra.lora import LORA_TARGETS, AdaptersOff, add_adapters, merged_state_dict
from trainer.infra.weights import build_config
from trainer.train_grpo import parse_args as grpo_parse_args


def lora_policy(seed=0, rank=4):
    """A tiny MiniMind (hidden 64, 2 layers), a plain copy of it, and the LoRA policy on it with its adapters and
    final-norm copy moved away from their start (B = 0 would make the policy equal the base)."""
    torch.manual_seed(seed)
    base = MiniMindForCausalLM(build_config(64, 2, 0)).eval()
    plain = copy.deepcopy(base)
    policy = add_adapters(base, rank, 2.0 * rank, 0.0, LORA_TARGETS)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return plain, policy


def test_the_reference_is_the_base_model_and_holds_no_weights():
    plain, policy = lora_policy()
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = AdaptersOff(policy)
    torch.testing.assert_close(reference(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert (policy(ids).logits - plain(ids).logits).abs().max() > 1e-2  # the adapters act outside the context
    assert list(reference.parameters()) == []
    assert reference.config.hidden_size == 64


def test_only_the_adapters_and_the_final_norms_copy_get_gradients():
    _, policy = lora_policy()
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(2))
    policy(ids).logits.logsumexp(-1).mean().backward()
    with_grad = sorted(name for name, p in policy.named_parameters() if p.grad is not None)
    blocks = (("self_attn", LORA_TARGETS[:4]), ("mlp", LORA_TARGETS[4:]))
    expected = sorted([f"base_model.model.model.layers.{i}.{block}.{proj}.lora_{ab}.default.weight"
                       for i in range(2) for block, projs in blocks for proj in projs for ab in "AB"]
                      + ["base_model.model.model.norm.modules_to_save.default.weight"])
    assert with_grad == expected


def test_the_merged_weights_load_into_minimind_and_give_the_policys_logits():
    _, policy = lora_policy()
    merged = MiniMindForCausalLM(build_config(64, 2, 0)).eval()
    merged.load_state_dict(merged_state_dict(policy), strict=True)
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(merged(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-5)
    plain = MiniMindForCausalLM(build_config(64, 2, 0))
    assert merged_state_dict(plain).keys() == plain.state_dict().keys()  # no adapters: the model's own


@pytest.mark.parametrize("flags, message", [
    (["--lora_rank", "-1"], "--lora_rank must be in [0, --hidden_size 256] (0 = off), got -1"),
    (["--lora_rank", "300"], "--lora_rank must be in [0, --hidden_size 256] (0 = off), got 300"),
    (["--lora_rank", "8", "--lora_target_modules", "qkv,o_proj"], "'qkv,o_proj': qkv matches no projection"),
    (["--lora_rank", "8", "--lora_alpha", "0"], "--lora_alpha must be > 0, got 0.0"),
    (["--lora_rank", "8", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
    (["--lora_rank", "8", "--use_moe", "1"], "--lora_rank is for dense models"),
])
def test_bad_lora_flags_are_refused_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo_parse_args(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_lora_flags_default_to_every_projection_at_alpha_2r():
    args = grpo_parse_args(["--lora_rank", "16"])
    assert args.lora_target_modules == LORA_TARGETS and args.lora_alpha == 32.0 and args.lora_dropout == 0.0
    assert grpo_parse_args([]).lora_rank == 0
