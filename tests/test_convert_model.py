"""scripts/convert_model.py: MiniMind .pth <-> transformers Qwen3ForCausalLM folder, logits equal both ways."""

import json
import os

import pytest
import torch
from transformers import Qwen3ForCausalLM

from model.hf_qwen3 import load_qwen3_folder, save_qwen3_folder
from model.model_minimind import MiniMindForCausalLM
from scripts.convert_model import main as convert_main
from trainer.infra.weights import build_config, load_weights


@pytest.fixture
def saved_policy(tmp_path):
    """A random MiniMind (hidden 64, 2 layers, large weights so logits differ visibly) saved as fp16 .pth."""
    torch.manual_seed(0)
    config = build_config(64, 2, 0)
    config.initializer_range = 0.2
    model = MiniMindForCausalLM(config)
    path = tmp_path / "policy_64.pth"
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path)
    load_weights(model, str(path))  # the model now holds exactly the fp16 values on disk
    return model.eval(), str(path)


def test_to_hf_and_back_keeps_logits(saved_policy, tmp_path):
    model, pth = saved_policy
    hf_dir = str(tmp_path / "hf")
    convert_main(["to_hf", "--weight", pth, "--hidden_size", "64", "--num_hidden_layers", "2", "--out", hf_dir])
    config_json = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    assert config_json["architectures"] == ["Qwen3ForCausalLM"] and config_json["model_type"] == "qwen3"
    assert os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    qwen = Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    torch.manual_seed(1)
    input_ids = torch.randint(0, 6400, (3, 13))
    with torch.no_grad():
        ours = model(input_ids).logits
        theirs = qwen(input_ids).logits
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max() <= 1e-4

    back = str(tmp_path / "back_64.pth")
    convert_main(["to_minimind", "--hf_dir", hf_dir, "--out", back])
    reloaded = MiniMindForCausalLM(build_config(64, 2, 0))
    load_weights(reloaded, back)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(input_ids).logits, ours)  # fp16 -> fp32 -> fp16 is lossless


def test_folder_written_by_transformers_loads(tmp_path):
    """A folder that transformers itself saved (lm_head tied, its own config.json) converts to MiniMind."""
    torch.manual_seed(2)
    config = build_config(64, 2, 0)
    config.initializer_range = 0.2
    ours = MiniMindForCausalLM(config).eval()
    save_qwen3_folder(ours.state_dict(), config, str(tmp_path / "a"))
    qwen = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "a")).eval()
    qwen.save_pretrained(str(tmp_path / "b"))
    lm_config, state_dict = load_qwen3_folder(str(tmp_path / "b"))
    reloaded = MiniMindForCausalLM(lm_config)
    reloaded.load_state_dict(state_dict, strict=True)
    input_ids = torch.randint(0, 6400, (2, 7))
    with torch.no_grad():
        assert (reloaded.eval()(input_ids).logits - qwen(input_ids).logits).abs().max() <= 1e-4


def test_rewrite_replaces_folder_without_leftovers(tmp_path):
    config = build_config(64, 2, 0)
    first = MiniMindForCausalLM(config).state_dict()
    second = {k: v + 1.0 for k, v in first.items()}
    save_qwen3_folder(first, config, str(tmp_path / "policy"))
    save_qwen3_folder(second, config, str(tmp_path / "policy"))
    assert os.listdir(tmp_path) == ["policy"]
    _, state_dict = load_qwen3_folder(str(tmp_path / "policy"))
    assert torch.equal(state_dict["model.norm.weight"], second["model.norm.weight"])


def test_moe_and_bad_folder_are_refused(tmp_path):
    with pytest.raises(ValueError, match="MoE"):
        save_qwen3_folder({}, build_config(64, 2, 1), str(tmp_path / "moe"))
    assert not os.path.exists(tmp_path / "moe")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_qwen3_folder(str(tmp_path / "empty"))
