"""MiniMind model: Qwen3 equivalence, left padding, KV-cache generation."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from model.model_minimind import CriticModel, MiniMindConfig, MiniMindForCausalLM


def make_model(config, std=0.2, seed=0):
    torch.manual_seed(seed)
    config.initializer_range = std  # large weights: logits differ visibly between positions
    return MiniMindForCausalLM(config).eval()


def test_defaults_are_minimind3():
    config = MiniMindConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 8, 8)
    assert config.num_key_value_heads == 4 and config.head_dim == 96
    assert config.intermediate_size == 2432  # ceil(768 * pi / 64) * 64 = 38 * 64
    assert config.vocab_size == 6400 and config.rope_theta == 1e6 and config.tie_word_embeddings


def test_parameter_names_match_minimind_checkpoints(tiny_config):
    names = set(MiniMindForCausalLM(tiny_config).state_dict())
    for name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]:
        assert name in names


def test_logits_equal_transformers_qwen3(tiny_config):
    model = make_model(tiny_config)
    qwen_config = Qwen3Config(
        vocab_size=tiny_config.vocab_size,
        hidden_size=tiny_config.hidden_size,
        intermediate_size=tiny_config.intermediate_size,
        num_hidden_layers=tiny_config.num_hidden_layers,
        num_attention_heads=tiny_config.num_attention_heads,
        num_key_value_heads=tiny_config.num_key_value_heads,
        head_dim=tiny_config.head_dim,
        rms_norm_eps=tiny_config.rms_norm_eps,
        rope_theta=tiny_config.rope_theta,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        attention_bias=False,
    )
    qwen = Qwen3ForCausalLM(qwen_config).eval()
    qwen.load_state_dict(model.state_dict(), strict=True)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 6400, (3, 17))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0  # left padding on one row
    with torch.no_grad():
        ours = model(input_ids, attention_mask=attention_mask).logits
        theirs = qwen(input_ids, attention_mask=attention_mask).logits
    assert ours.abs().max() > 1.0  # a meaningful comparison, not two near-zero tensors
    assert (ours[0, 5:] - theirs[0, 5:]).abs().max() <= 1e-4
    assert (ours[1:] - theirs[1:]).abs().max() <= 1e-4


def test_left_padded_rows_equal_rows_alone(tiny_config):
    model = make_model(tiny_config)
    torch.manual_seed(2)
    lengths = [9, 4, 6]
    rows = [torch.randint(3, 6400, (n,)) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = row
        attention_mask[i, width - len(row) :] = 1
    with torch.no_grad():
        batched = model(input_ids, attention_mask=attention_mask).logits
        for i, row in enumerate(rows):
            alone = model(row.unsqueeze(0)).logits[0]
            assert (batched[i, width - len(row) :] - alone).abs().max() <= 1e-5


def test_logits_to_keep(tiny_config):
    model = make_model(tiny_config)
    input_ids = torch.randint(0, 6400, (2, 10))
    with torch.no_grad():
        full = model(input_ids).logits
        last = model(input_ids, logits_to_keep=3).logits
    assert last.shape == (2, 3, 6400)
    assert torch.allclose(full[:, -3:], last, atol=1e-6)


def test_greedy_generate_with_cache_equals_recomputing_everything(tiny_config):
    """KV-cache decoding gives the tokens a plain loop of full forwards picks (left-padded batch)."""
    model = make_model(tiny_config)
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(input_ids, attention_mask, max_new_tokens=6, do_sample=False, eos_token_id=-1).output_ids
    for i in range(2):
        row = input_ids[i][attention_mask[i].bool()].tolist()
        for _ in range(6):
            with torch.no_grad():
                row.append(int(model(torch.tensor([row])).logits[0, -1].argmax()))
        assert out[i, 5:].tolist() == row[-6:]


def test_finished_rows_stay_finished(tiny_config):
    model = make_model(tiny_config)
    input_ids = torch.randint(3, 6400, (6, 4))
    with torch.no_grad():
        first = model(input_ids).logits[:, -1].argmax(-1)
    eos = int(first[0])  # row 0 emits "EOS" at its first greedy step
    out, logps = model.generate(input_ids, max_new_tokens=5, do_sample=False, eos_token_id=eos, pad_token_id=0)
    completion = out[:, 4:]
    assert logps.shape == completion.shape and (logps[0, 1:] == 0).all()  # no log-prob after a row's EOS
    assert completion[0, 0] == eos
    assert (completion[0, 1:] == 0).all()
    for row in completion.tolist():  # after the first EOS only padding
        if eos in row:
            assert all(t == 0 for t in row[row.index(eos) + 1 :])


def test_sampling_respects_top_k_and_is_reproducible(tiny_config):
    model = make_model(tiny_config)
    input_ids = torch.randint(3, 6400, (4, 5))
    with torch.no_grad():
        logits = model(input_ids).logits[:, -1]
    top2 = logits.topk(2, dim=-1).indices
    out1 = model.generate(
        input_ids, max_new_tokens=1, top_k=2, generator=torch.Generator().manual_seed(0), eos_token_id=-1
    ).output_ids
    out2 = model.generate(
        input_ids, max_new_tokens=1, top_k=2, generator=torch.Generator().manual_seed(0), eos_token_id=-1
    ).output_ids
    assert torch.equal(out1, out2)
    assert all(int(out1[i, -1]) in top2[i].tolist() for i in range(4))
    with pytest.raises(ValueError, match="top_p"):
        model.generate(input_ids, max_new_tokens=1, top_p=0.0)


def test_moe_forward_and_aux_loss():
    config = MiniMindConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_moe=True,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.1,
    )
    model = MiniMindForCausalLM(config)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in model.state_dict()
    assert "model.layers.0.mlp.gate.weight" in model.state_dict()
    model.train()
    out = model(torch.randint(0, 6400, (2, 8)))
    # Switch loss is coef * E * sum f_e P_e >= coef (equality when routing is uniform), per layer
    assert out.aux_loss.item() >= 2 * 0.1 - 1e-6
    out.logits.sum().backward()
    model.eval()
    assert model(torch.randint(0, 6400, (2, 8))).aux_loss.item() == 0.0


def test_critic_loads_actor_weights(tiny_config):
    actor = make_model(tiny_config)
    critic = CriticModel(tiny_config)
    critic.load_actor_state_dict(actor.state_dict())
    assert torch.equal(critic.model.embed_tokens.weight, actor.model.embed_tokens.weight)
    values = critic(torch.randint(0, 6400, (2, 7))).values
    assert values.shape == (2, 7) and values.dtype == torch.float32
    assert values.abs().max() == 0.0  # the value head starts at zero
    critic.value_head.weight.data.normal_()
    hidden, _ = actor.model(torch.tensor([[5, 6, 7]]))
    expected = hidden[0] @ critic.value_head.weight[0] + critic.value_head.bias[0]
    assert torch.allclose(critic(torch.tensor([[5, 6, 7]])).values[0], expected, atol=1e-5)
    bad = dict(actor.state_dict())
    bad.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        CriticModel(tiny_config).load_actor_state_dict(bad)


@pytest.mark.parametrize(
    "top_k, expected",
    [
        (0, [0.1, 0.2, 0.3, 0.4, 0.0]),
        (2, [0.0, 0.0, 3 / 7, 4 / 7, 0.0]),  # top-2 renormalised by hand
    ],
)
def test_inverse_cdf_sampler_matches_the_distribution(top_k, expected):
    """Frequencies of 200k draws against hand-written probabilities; a zero-probability token never appears."""
    from model.model_minimind import sample_next_token

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = probs.clamp(min=1e-30).log().expand(200_000, 5)  # [N, V]; log(0) -> a very small logit
    logits = torch.where(probs > 0, logits, torch.full_like(logits, float("-inf")))
    tokens = sample_next_token(logits, True, 1.0, 1.0, top_k, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    assert (counts - torch.tensor(expected, dtype=torch.float64)).abs().max() < 0.005
    assert all(counts[i] == 0 for i in range(5) if expected[i] == 0)


def test_sampler_never_picks_a_token_cut_by_top_p():
    from model.model_minimind import sample_next_token

    logits = torch.tensor([[3.0, 2.9, -1.0, -2.0]]).expand(50_000, 4)  # softmax ~ [0.51, 0.47, 0.01, 0.003]
    tokens = sample_next_token(logits, True, 1.0, 0.9, 0, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}


def test_sampler_refuses_nan_and_all_minus_inf_rows():
    from model.model_minimind import sample_next_token

    logits = torch.tensor([[0.0, 1.0, 0.0], [0.0, float("nan"), 0.0], [float("-inf")] * 3])
    with pytest.raises(ValueError, match=r"rows \[1, 2\] are NaN/inf or all -inf"):
        sample_next_token(logits, True, 1.0, 1.0, 0)
