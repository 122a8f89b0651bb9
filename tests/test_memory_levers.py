"""The memory levers give the update they replace: activation checkpointing (``--gradient_checkpointing``), the
log-probs from the hidden states in chunks (``--logprob_chunk_size``), micro-batches (``--micro_batch_size``) and the
reference in bf16 (``--ref_dtype``); and a run starts from a transformers ``Qwen3ForCausalLM`` folder and saves one.

The reference values come from the same computation with the lever off (the chapter's forward, the whole batch at
once, every activation kept), from a plain ``torch.log_softmax`` over the full logits, from ``aggregate_loss`` on the
whole batch, and from transformers' own ``Qwen3ForCausalLM``. Tolerances, per lever: checkpointing is bit-identical
(the same kernels run on the same tensors); chunks and micro-batches change the blocking of matrix products, so
values agree to 1e-6 and gradients to ||delta grad|| / ||grad|| <= 1e-6 (fp32).
"""

import contextlib
import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.model_minimind import CriticModel, KVCache, MiniMindConfig, MiniMindForCausalLM
from trainer import train_grpo
from trainer.grpo_family import LOSS_TYPES, aggregate_loss
from trainer.rollout_engine import RolloutResult, compute_per_token_logps
from trainer.speed.chunked_logps import chunked_per_token_logps
from trainer.speed.micro_batches import micro_batch_slices, micro_batch_weight
from trainer.trainer_utils import completion_mask_from_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS, PAD = 2, 0
RELATIVE = 1e-6


def tiny(use_moe=False, seed=0):
    torch.manual_seed(seed)
    config = MiniMindConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300
    )
    config.use_moe = use_moe
    config.initializer_range = 0.1
    return MiniMindForCausalLM(config)


def grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def relative_difference(first, second):
    """||delta grad|| / ||grad|| over the whole model's gradient (every parameter's, as one vector)."""
    first = torch.cat([g.flatten() for g in first])
    second = torch.cat([g.flatten() for g in second])
    return float((first - second).norm() / first.norm())


def batch(rows=6, prompt_len=5, completion_len=7, vocab=300, seed=1):
    """Left-padded prompts and answers of ragged lengths: (input_ids [N, P + R], attention_mask [N, P + R])."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, prompt_len + completion_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(rows):
        attention_mask[row, : row % 3] = 0  # left padding
        input_ids[row, : row % 3] = PAD
        end = prompt_len + (row * 2) % (completion_len - 1)  # an EOS (the last row: none, cut at R), then padding
        if row == rows - 1:
            continue
        input_ids[row, end] = EOS
        input_ids[row, end + 1 :] = PAD
        attention_mask[row, end + 1 :] = 0
    return input_ids, attention_mask


# ----------------------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize("use_moe", [False, True])
def test_checkpointing_gives_the_same_loss_and_gradients_bit_for_bit(use_moe):
    model = tiny(use_moe).train()
    input_ids, attention_mask = batch()

    def loss_and_grads():
        model.zero_grad()
        out = model(input_ids, attention_mask=attention_mask)
        loss = torch.log_softmax(out.logits.float(), -1)[..., 7].mean() + out.aux_loss
        loss.backward()
        return loss.detach(), grads(model)

    loss_off, grads_off = loss_and_grads()
    model.activation_checkpointing_enable({"use_reentrant": False})  # transformers' API, as the scripts call it
    assert model.model.gradient_checkpointing
    loss_on, grads_on = loss_and_grads()
    assert torch.equal(loss_off, loss_on)
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))


def test_checkpointing_the_critic_gives_the_same_value_gradients():
    actor = tiny()
    critic = CriticModel(actor.config)
    critic.load_actor_state_dict(actor.state_dict())
    torch.nn.init.normal_(critic.value_head.weight)  # a head that is not 0, so the backbone gets a gradient
    input_ids, attention_mask = batch()

    def value_grads():
        critic.zero_grad()
        critic(input_ids, attention_mask=attention_mask).values.pow(2).mean().backward()
        return grads(critic)

    grads_off = value_grads()
    critic.activation_checkpointing_enable({"use_reentrant": False})
    grads_on = value_grads()
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
    assert grads_off[0].abs().sum() > 0  # the embedding got a gradient through the checkpointed blocks


def test_a_checkpointed_training_forward_refuses_a_kv_cache():
    model = tiny().train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(ValueError, match="--shared_prefix 0"):
        model(torch.tensor([[5, 6, 7]]), past_key_values=KVCache(2))
    with torch.no_grad():  # generation: no gradient, so no checkpointing, and the cache works
        assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).output_ids.shape == (1, 6)


# ----------------------------------------------------------------------------- log-probs in chunks
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000])
def test_chunked_log_probs_equal_the_chapters_forward(chunk_size):
    model = tiny()
    input_ids, attention_mask = batch()
    completion_len = 7
    weights = torch.linspace(-1.0, 2.0, 6 * completion_len).reshape(6, completion_len)  # [N, R], a fixed loss

    def run(forward, **kwargs):
        model.zero_grad()
        out = forward(model, input_ids, completion_len, attention_mask, 0.7, True, **kwargs)
        (out.per_token_logps * weights).sum().backward()
        return out, grads(model)

    chapter, chapter_grads = run(compute_per_token_logps)
    chunked, chunked_grads = run(chunked_per_token_logps, chunk_size=chunk_size)
    # the plain formula on the full logits: log_softmax(logits / T) of the next token
    logits = model(input_ids, attention_mask=attention_mask).logits[:, -completion_len - 1 : -1].detach()
    plain = torch.log_softmax(logits / 0.7, -1).gather(-1, input_ids[:, -completion_len:, None]).squeeze(-1)
    torch.testing.assert_close(chunked.per_token_logps, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.per_token_logps, chapter.per_token_logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.entropies, chapter.entropies, rtol=0, atol=1e-5)
    assert relative_difference(chapter_grads, chunked_grads) <= RELATIVE


class LargestLogits(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns that holds one value per (token, vocabulary
    entry): its last dimension is the vocabulary, and it is not the LM head's weight or its transpose."""

    def __init__(self, vocab_size, hidden_size):
        super().__init__()
        self.vocab_size, self.weight_shapes, self.largest = vocab_size, {(vocab_size, hidden_size)}, 0
        self.weight_shapes.add((hidden_size, vocab_size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.size(-1) != self.vocab_size:
                continue
            if tuple(tensor.shape) not in self.weight_shapes:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_full_logits_exist_in_the_chunked_forward_nor_in_its_backward():
    model = tiny()
    input_ids, attention_mask = batch()
    rows, completion_len, vocab = 6, 7, model.config.vocab_size
    with LargestLogits(vocab, model.config.hidden_size) as chapter:
        out = compute_per_token_logps(model, input_ids, completion_len, attention_mask)
        out.per_token_logps.sum().backward()
    with LargestLogits(vocab, model.config.hidden_size) as chunked:
        out = chunked_per_token_logps(model, input_ids, completion_len, attention_mask, chunk_size=5)
        out.per_token_logps.sum().backward()
    assert chapter.largest == rows * (completion_len + 1) * vocab  # the chapter's logits [N, R + 1, V]
    assert chunked.largest == 5 * vocab  # one chunk's logits [1, 5, V], in the forward and in the backward


def test_the_shared_prefix_forward_in_chunks_equals_it_without():
    model = tiny()
    prompt_ids = torch.tensor([[PAD, 11, 12, 13], [21, 22, 23, 24]])  # [2, 4]
    prompt_mask = (prompt_ids != PAD).long()
    completion_ids = torch.tensor([[41, 42, EOS, PAD], [EOS, PAD, PAD, PAD], [45, 46, 47, 48]] * 2)  # [6, 4]
    completion_mask = completion_mask_from_ids(completion_ids, EOS)
    rollout = RolloutResult(
        output_ids=torch.cat([prompt_ids.repeat_interleave(3, 0), completion_ids], 1),
        completion_ids=completion_ids,
        per_token_logps=torch.zeros(6, 4),
        completions=[""] * 6,
        completion_mask=completion_mask,
        prompt_mask=prompt_mask.repeat_interleave(3, 0),
    )
    results = []
    for chunk_size in (0, 3):
        model.zero_grad()
        out = train_grpo.group_policy_forward(model, rollout, 3, 0.9, True, True, chunk_size)
        (out.per_token_logps * completion_mask).sum().backward()
        results.append((out, grads(model)))
    (plain, plain_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked.per_token_logps, plain.per_token_logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.entropies, plain.entropies, rtol=0, atol=1e-5)
    assert relative_difference(plain_grads, chunked_grads) <= RELATIVE


# ----------------------------------------------------------------------------- micro-batches
def test_micro_batch_slices_cover_the_rows_in_whole_groups():
    assert micro_batch_slices(12, 0) == [slice(0, 12)]
    assert micro_batch_slices(12, 5) == [slice(0, 5), slice(5, 10), slice(10, 12)]
    assert micro_batch_slices(12, 6, group_size=6) == [slice(0, 6), slice(6, 12)]
    with pytest.raises(ValueError, match="multiple of the group size 6"):
        micro_batch_slices(12, 4, group_size=6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weighted_micro_batch_losses_add_up_to_the_whole_batch_loss(loss_type):
    generator = torch.Generator().manual_seed(3)
    per_token_loss = torch.randn(7, 5, generator=generator, dtype=torch.float64)  # [N, R]
    completion_mask = (torch.rand(7, 5, generator=generator) < 0.7).long()
    completion_mask[4] = 0  # an answer with no token
    num_items = float(completion_mask.sum())  # dapo / vespo: the token sum over the batch's tokens
    whole = aggregate_loss(per_token_loss, completion_mask, loss_type, 5, num_items)
    total = 0.0
    for rows in micro_batch_slices(7, 3):
        part = aggregate_loss(per_token_loss[rows], completion_mask[rows], loss_type, 5, num_items)
        weight = micro_batch_weight(loss_type, rows.stop - rows.start, 7, completion_mask[rows].sum(), num_items)
        total = total + weight * part
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def rollout_batch(rows=6, completion_len=6, seed=2):
    """A ``GRPORolloutBatch`` of 2 prompts x 3 answers with sampler log-probs slightly off the policy's, a reference,
    advantages and rewards: what ``grpo_rollout`` hands to the update."""
    generator = torch.Generator().manual_seed(seed)
    input_ids, attention_mask = batch(rows, 5, completion_len, seed=seed)
    completion_ids = input_ids[:, -completion_len:]
    completion_mask = attention_mask[:, -completion_len:]
    with torch.no_grad():
        policy_logps = compute_per_token_logps(tiny(), input_ids, completion_len, attention_mask).per_token_logps
        ref_logps = compute_per_token_logps(tiny(seed=5), input_ids, completion_len, attention_mask).per_token_logps
    noise = 0.3 * torch.randn(rows, completion_len, generator=generator)
    rollout = RolloutResult(
        output_ids=input_ids,
        completion_ids=completion_ids,
        per_token_logps=(policy_logps + noise) * completion_mask,  # an off-policy sampler: ratios leave 1
        completions=[""] * rows,
        completion_mask=completion_mask,
        prompt_mask=attention_mask[:, :-completion_len],
    )
    rewards = torch.randn(rows, generator=generator)
    return train_grpo.GRPORolloutBatch(
        rollout=rollout,
        completion_mask=completion_mask,
        advantages=torch.randn(rows, generator=generator),
        ref_per_token_logps=ref_logps,
        rewards=rewards,
        reward_parts={"rewards": rewards},
        num_items_in_batch=float(completion_mask.sum()),
        debug={},
        metrics={},
    )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_a_micro_batched_update_equals_the_whole_batch_update(loss_type, micro_batch_size):
    args = train_grpo.parse_args(
        ["--loss_type", loss_type, "--shared_prefix", "0", "--num_generations", "3", "--max_gen_len", "6"]
    )
    loss_config = train_grpo.build_loss_config(args)
    data = rollout_batch()
    model = tiny().train()
    results = []
    for size in (0, micro_batch_size):
        model.zero_grad()
        outputs, weights = [], []
        for micro_batch, weight in train_grpo.grpo_micro_batches(data, size, 1, loss_config.loss_type):
            loss, micro_outputs = train_grpo.grpo_policy_loss(
                model, micro_batch, loss_config, args, contextlib.nullcontext()
            )
            (loss * weight).backward()
            outputs.append(micro_outputs)
            weights.append(weight)
        metrics = train_grpo.grpo_update_metrics(outputs, weights, data, loss_config)
        results.append((metrics, grads(model), len(outputs)))
    (whole_metrics, whole_grads, one), (micro_metrics, micro_grads, parts) = results
    assert one == 1 and parts == -(-6 // micro_batch_size)
    assert relative_difference(whole_grads, micro_grads) <= RELATIVE
    assert whole_metrics.keys() == micro_metrics.keys()
    for key, value in whole_metrics.items():
        assert micro_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# ----------------------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gradient_checkpointing", "1", "--shared_prefix", "1"], "write them again"),
        (["--micro_batch_size", "4"], "multiple of --num_generations 6"),
        (["--ref_dtype", "bfloat16", "--lora_rank", "8"], "adapters switched off"),
    ],
)
def test_grpo_refuses_lever_pairs_that_cannot_work_and_names_why(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_grpo.parse_args(argv)
    assert message in capsys.readouterr().err


def test_checkpointing_turns_the_shared_prefix_off_by_default():
    assert train_grpo.parse_args([]).shared_prefix == 1
    assert train_grpo.parse_args(["--gradient_checkpointing", "1"]).shared_prefix == 0


def test_the_agent_script_refuses_micro_batches_with_the_way_on(capsys):
    from trainer import train_agent

    with pytest.raises(SystemExit):
        train_agent.parse_args(["--micro_batch_size", "2"])
    assert "--gradient_checkpointing 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the reference in bf16
@pytest.mark.parametrize("dtype_name, mean_bound, p99_bound", [("bfloat16", 0.01, 0.2), ("float16", 0.001, 0.02)])
def test_a_half_precision_reference_keeps_its_log_probs_within_the_stated_tolerance(dtype_name, mean_bound, p99_bound):
    """docs/memory.md states the bounds, measured on the bundled policy's own answers to 32 validation prompts (1,464
    answer tokens): |log pi_ref(half) - log pi_ref(fp32)| averages 0.0039 nat in bf16 (99th percentile 0.10, largest
    0.48) and 0.00038 in fp16 (0.009, 0.034)."""
    from dataset.lm_dataset import RLAIFDataset
    from trainer.infra.weights import build_config, frozen_copy, init_model
    from trainer.rollout_engine import tokenize_prompts

    model, tokenizer = init_model(build_config(256, 4, 0), "full_sft", os.path.join(ROOT, "out"))
    prompts = RLAIFDataset(os.path.join(ROOT, "dataset", "rlaif_val.jsonl"), tokenizer, seed=0)
    prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, [prompts[i]["prompt"] for i in range(32)], 256, "cpu")
    torch.manual_seed(0)
    output_ids = model.generate(prompt_ids, prompt_mask, max_new_tokens=96).output_ids  # [32, P + R]
    completion_len = output_ids.size(1) - prompt_ids.size(1)
    completion_mask = completion_mask_from_ids(output_ids[:, -completion_len:], tokenizer.eos_token_id)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    reference, half = frozen_copy(model), frozen_copy(model, dtype_name)
    assert next(half.parameters()).dtype == getattr(torch, dtype_name)
    with torch.no_grad():
        full_logps = compute_per_token_logps(reference, output_ids, completion_len, mask).per_token_logps
        half_logps = compute_per_token_logps(half, output_ids, completion_len, mask).per_token_logps
    difference = (half_logps - full_logps).abs()[completion_mask.bool()]
    assert difference.mean() <= mean_bound and difference.quantile(0.99) <= p99_bound
    assert difference.max() > 0  # the weights were rounded


# ----------------------------------------------------------------------------- a Qwen3 folder in, a Qwen3 folder out
@pytest.fixture
def qwen3_folder(tmp_path, tokenizer):
    """A tiny ``Qwen3ForCausalLM`` built and saved by transformers, with the bundled tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    folder = str(tmp_path / "qwen3_start")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def transformers_logits(folder, input_ids):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def minimind_logits(folder, input_ids):
    from trainer.infra.weights import folder_config, init_model

    model, _ = init_model(folder_config(folder), folder, tokenizer_path=folder)
    with torch.no_grad():
        return model.eval()(input_ids).logits


def test_grpo_starts_from_a_qwen3_folder_and_saves_one_transformers_loads(
    qwen3_folder, small_data, tmp_path, restore_signals
):
    input_ids = torch.tensor([[5, 17, 300, 42, 511, 7]])
    torch.testing.assert_close(
        minimind_logits(qwen3_folder, input_ids), transformers_logits(qwen3_folder, input_ids), rtol=0, atol=1e-5
    )
    save_dir = tmp_path / "out"
    levers = ["--gradient_checkpointing", "1", "--micro_batch_size", "2", "--logprob_chunk_size", "16"]
    train_grpo.main(
        ["--from_weight", qwen3_folder, "--data_path", small_data, "--save_dir", str(save_dir), "--max_steps", "2"]
        + ["--max_gen_len", "8", "--batch_size", "2", "--num_generations", "3", "--eval_interval", "0"]
        + ["--reward_model_path", "none", "--learning_rate", "1e-3", "--ref_dtype", "bfloat16", *levers]
    )
    folder = str(save_dir / "grpo_64_hf")  # the run's architecture: hidden 64 from the folder's config.json
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 512
    trained = transformers_logits(folder, input_ids)
    torch.testing.assert_close(minimind_logits(folder, input_ids), trained, rtol=0, atol=1e-5)
    assert not torch.allclose(trained, transformers_logits(qwen3_folder, input_ids), atol=1e-3)  # it trained
    # and the folder is a start again: --from_weight FOLDER with its own tokenizer
    args = train_grpo.parse_args(["--from_weight", folder, "--data_path", small_data])
    assert (args.hidden_size, args.num_attention_heads, args.head_dim, args.vocab_size) == (64, 4, 32, 512)
    assert args.tokenizer_path == folder


def test_a_folder_start_refuses_an_architecture_flag_that_contradicts_it(qwen3_folder, small_data, capsys):
    with pytest.raises(SystemExit):
        train_grpo.parse_args(["--from_weight", qwen3_folder, "--data_path", small_data, "--hidden_size", "128"])
    assert "holds a model of hidden_size 64" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the optimizer's state in 8 bits
def test_adamw_8bit_follows_torchs_adamw_within_its_quantization_or_names_the_install():
    """Three AdamW steps on the same gradients: torchao's AdamW8bit (``--optimizer adamw_8bit``) moves the weights as
    torch's AdamW does, to its 8-bit moments' rounding (measured: 0.7 % of the update); a tensor under 4,096 values
    keeps fp32 moments, so it follows to float rounding. torchao is an optional install (requirements.txt leaves it
    out): without it, the optimizer is refused naming the pip command."""
    import importlib.util

    from trainer.infra.optimizer import adamw

    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ImportError, match=r"pip install torchao==0\.18\.0"):
            adamw([torch.nn.Parameter(torch.zeros(3))], "adamw_8bit", lr=1e-3)
        return
    torch.manual_seed(0)
    start = [torch.randn(64, 128), torch.randn(300, 64), torch.randn(64)]
    gradients = [[torch.randn_like(p) for p in start] for _ in range(3)]
    updates = {}
    for name in ("adamw", "adamw_8bit"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = adamw(params, name, lr=1e-3, weight_decay=0.01)
        for step_gradients in gradients:
            for param, gradient in zip(params, step_gradients):
                param.grad = gradient.clone()
            optimizer.step()
        updates[name] = [p.detach() - s for p, s in zip(params, start)]
    for full, eight_bit, bound in zip(updates["adamw"], updates["adamw_8bit"], (0.02, 0.02, 1e-4)):
        assert float((full - eight_bit).norm() / full.norm()) <= bound
    assert float((updates["adamw"][0] - updates["adamw_8bit"][0]).norm()) > 0  # the moments were quantized


def test_a_run_that_would_overwrite_its_starting_folder_is_refused(qwen3_folder, small_data, tmp_path):
    import shutil

    from trainer.infra.checkpoints import check_start_weights_kept
    from trainer.infra.errors import InputError

    save_dir = tmp_path / "out"
    own_output = save_dir / "grpo_64_hf"  # what a run with --save_weight grpo writes
    shutil.copytree(qwen3_folder, own_output)
    args = train_grpo.parse_args(
        ["--from_weight", str(own_output), "--data_path", small_data, "--save_dir", str(save_dir)]
    )
    with pytest.raises(InputError, match="overwrite its starting"):
        check_start_weights_kept(args)
    args = train_grpo.parse_args(
        ["--from_weight", str(own_output), "--data_path", small_data, "--save_dir", str(save_dir), "--save_weight", "b"]
    )
    check_start_weights_kept(args)  # another --save_weight writes b_64_hf/


def test_lora_adapters_of_a_folder_start_name_the_folder_as_their_base(
    qwen3_folder, small_data, tmp_path, restore_signals
):
    save_dir = tmp_path / "out"
    train_grpo.main(
        ["--from_weight", qwen3_folder, "--data_path", small_data, "--save_dir", str(save_dir), "--max_steps", "1"]
        + ["--max_gen_len", "6", "--batch_size", "2", "--num_generations", "2", "--eval_interval", "0"]
        + ["--reward_model_path", "none", "--lora_rank", "4", "--gradient_checkpointing", "1"]
    )
    with open(save_dir / "grpo_64_lora" / "adapter_config.json", encoding="utf-8") as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(qwen3_folder)


def test_an_architecture_mismatch_names_the_new_architecture_flags(small_data):
    from trainer.infra.errors import InputError
    from trainer.infra.weights import build_config, init_model

    with pytest.raises(InputError, match="--intermediate_size"):
        init_model(build_config(256, 4, 0, intermediate_size=512), "full_sft", os.path.join(ROOT, "out"))


def test_sft_resolves_a_folder_start_before_looking_for_its_resume_file(qwen3_folder, tmp_path):
    from trainer import train_full_sft

    (tmp_path / "full_sft_64_resume.pth").write_bytes(b"")  # named after the folder's hidden size 64, not 256
    args = train_full_sft.parse_args(["--from_weight", qwen3_folder, "--save_dir", str(tmp_path), "--from_resume", "1"])
    assert (args.hidden_size, args.tokenizer_path) == (64, qwen3_folder)
