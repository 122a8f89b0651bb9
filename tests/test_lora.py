"""--lora_rank (trainer/infra/lora.py): the reference is the base model, only the adapters and the final norm's
copy learn (and PPO's critic head), the merged weights are the policy's, the adapter folder is peft's format and
``convert_model.py merge_lora`` merges it as peft does, the flags and adapter checkpoints are checked; the resume is
in tests/test_resume.py."""

import argparse
import copy
import os
import subprocess
import sys

import pytest
import torch
from peft import PeftModel

from conftest import ROOT
from model.model_minimind import CriticModel, MiniMindForCausalLM
from trainer.infra.errors import InputError
from trainer.infra.lora import (
    LORA_TARGETS,
    AdaptersOff,
    add_adapters,
    critic_with_adapters,
    merged_state_dict,
    save_adapters,
)
from trainer.infra.weights import build_config, init_model, load_tensors_only, save_weights
from trainer.train_grpo import parse_args as grpo_parse_args
from scripts import convert_model


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
    expected = sorted(
        [
            f"base_model.model.model.layers.{i}.{block}.{proj}.lora_{ab}.default.weight"
            for i in range(2)
            for block, projs in blocks
            for proj in projs
            for ab in "AB"
        ]
        + ["base_model.model.model.norm.modules_to_save.default.weight"]
    )
    assert with_grad == expected


def test_the_merged_weights_load_into_minimind_and_give_the_policys_logits():
    _, policy = lora_policy()
    merged = MiniMindForCausalLM(build_config(64, 2, 0)).eval()
    merged.load_state_dict(merged_state_dict(policy), strict=True)
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(merged(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-5)
    plain = MiniMindForCausalLM(build_config(64, 2, 0))
    assert merged_state_dict(plain).keys() == plain.state_dict().keys()  # no adapters: the model's own


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_rank", "-1"], "--lora_rank must be in [0, --hidden_size 256] (0 = off), got -1"),
        (["--lora_rank", "300"], "--lora_rank must be in [0, --hidden_size 256] (0 = off), got 300"),
        (["--lora_rank", "8", "--lora_target_modules", "qkv,o_proj"], "'qkv,o_proj': qkv matches no projection"),
        (["--lora_rank", "8", "--lora_alpha", "0"], "--lora_alpha must be > 0, got 0.0"),
        (["--lora_rank", "8", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
        (["--lora_rank", "8", "--use_moe", "1"], "--lora_rank is for dense models"),
    ],
)
def test_bad_lora_flags_are_refused_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo_parse_args(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_lora_flags_default_to_every_projection_at_alpha_2r():
    args = grpo_parse_args(["--lora_rank", "16"])
    assert args.lora_target_modules == LORA_TARGETS and args.lora_alpha == 32.0 and args.lora_dropout == 0.0
    assert grpo_parse_args([]).lora_rank == 0


def lora_flags(base_path, rank=4):
    return argparse.Namespace(
        lora_rank=rank,
        lora_alpha=2.0 * rank,
        lora_dropout=0.0,
        lora_target_modules=LORA_TARGETS,
        from_weight=base_path,
        save_dir=os.path.dirname(base_path),
        hidden_size=64,
        use_moe=0,
    )


def moved(model, scale=0.05, seed=4):
    """``model`` with every trained tensor (adapters, copies trained in full) moved away from its start."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


def saved_base(tmp_path):
    """A tiny MiniMind saved as fp32 {tmp}/base_64.pth with its tokenizer record; returns (path, model)."""
    torch.manual_seed(5)
    base = MiniMindForCausalLM(build_config(64, 2, 0)).eval()
    path = str(tmp_path / "base_64.pth")
    save_weights(base.state_dict(), path, os.path.join(ROOT, "model"))
    return path, base


def test_the_critics_adapters_start_at_the_full_critic_and_only_they_and_the_head_learn():
    torch.manual_seed(6)
    critic = CriticModel(build_config(64, 2, 0))
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # a head that is not 0, so the values compare
    plain = copy.deepcopy(critic)
    lora_critic = critic_with_adapters(critic, lora_flags("none"))
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(lora_critic(ids).values, plain(ids).values, rtol=0, atol=0)  # B = 0 at the start
    lora_critic(ids).values.square().mean().backward()
    with_grad = {name for name, p in lora_critic.named_parameters() if p.grad is not None}
    trained_in_full = {
        "base_model.model.model.norm.modules_to_save.default.weight",
        "base_model.model.value_head.modules_to_save.default.weight",
        "base_model.model.value_head.modules_to_save.default.bias",
    }
    assert trained_in_full <= with_grad
    assert {name for name in with_grad - trained_in_full if ".lora_A." not in name and ".lora_B." not in name} == set()
    assert sum(".lora_B." in name for name in with_grad) == 2 * len(LORA_TARGETS)  # every projection of 2 layers
    assert critic_with_adapters(plain, lora_flags("none", rank=0)) is plain  # --lora_rank 0: the full critic


def test_the_adapter_folder_is_pefts_format_and_records_the_base(tmp_path):
    base_path, base = saved_base(tmp_path)
    policy = moved(add_adapters(copy.deepcopy(base), 4, 8.0, 0.0, LORA_TARGETS, base_path=base_path))
    save_adapters(policy, str(tmp_path / "adapters"))
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapters"))  # peft reads it back
    assert loaded.peft_config["default"].base_model_name_or_path == base_path
    ids = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("role", "command"), [("policy", "merge_lora"), ("critic", "merge_lora"), ("policy", "--merge_lora")]
)  # the flag spelling, the same command
def test_merge_lora_writes_what_pefts_merge_and_unload_gives(role, command, tmp_path):
    base_path, base = saved_base(tmp_path)
    if role == "policy":
        model = add_adapters(copy.deepcopy(base), 4, 8.0, 0.0, LORA_TARGETS, base_path=base_path)
    else:
        critic = CriticModel(build_config(64, 2, 0))
        critic.load_actor_state_dict(base.state_dict())
        model = critic_with_adapters(critic, lora_flags(base_path))
    moved(model)
    save_adapters(model, str(tmp_path / "adapters"))
    out = str(tmp_path / "merged_64.pth")
    convert_model.main([command, "--adapter", str(tmp_path / "adapters"), "--dtype", "float32", "--out", out])
    merged = load_tensors_only(out)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge
    assert merged.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)
    assert os.path.isfile(str(tmp_path / "merged_64.tokenizer.json"))  # the tokenizer record beside it


def test_merge_lora_refuses_a_folder_that_is_not_adapters_or_does_not_fit_the_base(tmp_path):
    base_path, base = saved_base(tmp_path)
    with pytest.raises(InputError, match="no adapter_config.json, so it is not a peft adapter folder"):
        convert_model.main(["merge_lora", "--adapter", str(tmp_path), "--out", str(tmp_path / "m.pth")])
    policy = add_adapters(copy.deepcopy(base), 4, 8.0, 0.0, LORA_TARGETS)  # no base recorded
    save_adapters(policy, str(tmp_path / "adapters"))
    with pytest.raises(InputError, match="names no base weights .base_model_name_or_path.: pass --weight"):
        convert_model.main(["merge_lora", "--adapter", str(tmp_path / "adapters"), "--out", str(tmp_path / "m.pth")])
    other = MiniMindForCausalLM(build_config(128, 2, 0))  # another hidden size
    save_weights(other.state_dict(), str(tmp_path / "other_128.pth"), os.path.join(ROOT, "model"))
    with pytest.raises(
        InputError,
        match=r"does not fit the base .*other_128.pth.*lora_A.weight \(4, 64\) "
        r"\(the base needs \(4, 128\)\)",
    ):
        convert_model.main(
            [
                "merge_lora",
                "--adapter",
                str(tmp_path / "adapters"),
                "--weight",
                str(tmp_path / "other_128.pth"),
                "--out",
                str(tmp_path / "m.pth"),
            ]
        )
    assert not os.path.exists(tmp_path / "m.pth")


def test_a_start_checkpoint_holding_adapters_is_refused_with_the_merge_command(tmp_path):
    base_path, base = saved_base(tmp_path)
    policy = add_adapters(copy.deepcopy(base), 4, 8.0, 0.0, LORA_TARGETS, base_path=base_path)
    save_adapters(policy, str(tmp_path / "grpo_64_lora"))
    torch.save(policy.state_dict(), tmp_path / "peft_64.pth")  # a peft model's own state dict
    config = build_config(64, 2, 0)
    for start in (str(tmp_path / "grpo_64_lora"), str(tmp_path / "peft_64.pth")):
        with pytest.raises(InputError, match="merge_lora --adapter FOLDER --out merged.pth"):
            init_model(config, start, str(tmp_path))
    result = subprocess.run(
        [
            sys.executable,
            "trainer/train_grpo.py",
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "2",
            "--lora_rank",
            "4",
            "--from_weight",
            str(tmp_path / "grpo_64_lora"),
            "--save_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train_grpo.py: error: --from_weight {tmp_path / 'grpo_64_lora'} is a LoRA adapter folder")
    assert "Traceback" not in result.stderr


def test_a_ppo_runs_adapter_folders_merge_into_its_saved_weights_bit_for_bit(tmp_path, tiny_weights, small_data):
    from test_resume import TINY, harness

    flags = TINY + [
        "--batch_size",
        "2",
        "--mini_batch_size",
        "1",
        "--max_steps",
        "2",
        "--lora_rank",
        "4",
        "--save_dir",
        tiny_weights[0],
        "--run_dir",
        str(tmp_path / "run"),
        "--data_path",
        small_data,
    ]
    result = harness("ppo", ["--text_reward"], flags)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("ppo_64", "ppo_critic_64"):  # the policy's adapters and the critic's
        out = str(tmp_path / f"merged_{name}.pth")
        convert_model.main(["merge_lora", "--adapter", str(tmp_path / f"{name}_lora"), "--out", out])
        saved, merged = load_tensors_only(str(tmp_path / f"{name}.pth")), load_tensors_only(out)
        assert saved.keys() == merged.keys()
        assert all(torch.equal(saved[key], merged[key]) for key in saved), name
        start = load_tensors_only(str(tmp_path / "tiny_64.pth"))
        assert not torch.equal(
            saved["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"]
        )  # the adapters did learn
