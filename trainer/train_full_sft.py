"""Supervised fine-tuning: makes the starting policy of the embedded default (``out/full_sft_256.pth``).

The loss is next-token cross-entropy on assistant tokens only (``SFTDataset``). The committed checkpoint
was made with the defaults:

    python trainer/train_full_sft.py

Other examples:
    python trainer/train_full_sft.py --max_steps 100 --save_weight tiny_sft
    torchrun --nproc_per_node 2 trainer/train_full_sft.py

A long run (``--save_interval N``) also writes ``{save_dir}/{save_weight}_{hidden}_resume.pth`` every N steps
(fp32 weights, optimizer, schedule, data position); the same command with ``--from_resume 1`` continues it and
ends with the weights an uninterrupted run ends with.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from dataset.lm_dataset import SFTDataset, sft_collate
from trainer.infra.distributed import (
    Logger,
    any_rank,
    init_distributed_mode,
    is_main_process,
    setup_seed,
    unwrap_model,
)
from trainer.infra.errors import InputError, run_script
from trainer.infra.files import atomic_write, check_writable_dir
from trainer.infra.flags import add_bool_flag
from trainer.infra.optimizer import build_cosine_scheduler, project_scale_only_gradients
from trainer.infra.stopping import BadStepGuard, nonfinite_parts
from model.hf_qwen3 import write_folder_atomically
from trainer.infra.weights import (
    DEFAULT_SAVE_DIR,
    DEFAULT_TOKENIZER_PATH,
    build_config,
    folder_config,
    half_state_dict,
    init_model,
    is_model_folder,
    model_folder_path,
    save_weights,
    weight_path,
    write_model_folder,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind full SFT (assistant-token cross-entropy)")
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "sft_data.jsonl"))
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    parser.add_argument("--save_weight", default="full_sft")
    parser.add_argument(
        "--from_weight",
        default="none",
        help="'none' = random init, a .pth, or a transformers Qwen3ForCausalLM folder (its config.json sets the "
        "architecture, its tokenizer the tokenizer; the run then also saves {save_weight}_{hidden}_hf/)",
    )
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    add_bool_flag(parser, "--use_moe", help="1: mixture-of-experts MLPs")
    add_bool_flag(
        parser,
        "--gradient_checkpointing",
        help="1: keep each block's input only and recompute the block in the backward (less memory, more compute)",
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=800, help="optimizer steps (0 = whole epochs)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--log_interval", type=int, default=50)
    parser.add_argument(
        "--save_interval",
        type=int,
        default=0,
        help="also save a snapshot {save_weight}_step{N}_{hidden}.pth and the resume file "
        "{save_weight}_{hidden}_resume.pth every N steps (0 = off)",
    )
    add_bool_flag(
        parser,
        "--from_resume",
        help="1: continue the run whose resume file {save_weight}_{hidden}_resume.pth is in --save_dir",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    parser.add_argument(
        "--max_bad_steps", type=int, default=3, help="stop after this many updates in a row skipped for a NaN/inf"
    )
    args = parser.parse_args(argv)
    for flag in ("batch_size", "max_seq_len", "epochs", "max_bad_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.max_steps < 0 or args.save_interval < 0 or args.log_interval < 1 or args.grad_clip <= 0:
        parser.error("--max_steps and --save_interval must be >= 0, --log_interval >= 1, --grad_clip > 0")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    args.tokenizer_path = DEFAULT_TOKENIZER_PATH
    if is_model_folder(args.from_weight):  # a Qwen3ForCausalLM folder: its architecture and, if it has one, tokenizer
        try:
            config = folder_config(args.from_weight)
        except ValueError as err:
            parser.error(str(err))
        for flag, value in (("hidden_size", config.hidden_size), ("num_hidden_layers", config.num_hidden_layers)):
            if getattr(args, flag) not in (parser.get_default(flag), value):
                parser.error(
                    f"--{flag} {getattr(args, flag)} but --from_weight {args.from_weight} holds a model of {flag} "
                    f"{value} (its config.json sets the architecture): leave --{flag} out"
                )
            setattr(args, flag, value)
        if args.use_moe:
            parser.error(f"--use_moe 1 with --from_weight {args.from_weight}: a Qwen3ForCausalLM folder is dense")
        if any(os.path.isfile(os.path.join(args.from_weight, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
            args.tokenizer_path = args.from_weight
    try:
        check_writable_dir(args.save_dir)
    except OSError as err:
        parser.error(f"--save_dir: {err.strerror}")
    if args.from_resume and not os.path.isfile(resume_path(args)):
        parser.error(
            f"--from_resume 1: no resume file {resume_path(args)} (a run with --save_interval N writes it "
            f"every N steps)"
        )
    return args


RESUME_KEYS = (
    "data_path",
    "from_weight",
    "hidden_size",
    "num_hidden_layers",
    "use_moe",
    "batch_size",
    "learning_rate",
    "weight_decay",
    "max_seq_len",
    "max_steps",
    "epochs",
    "seed",
)  # must match to resume


def resume_path(args):
    """``{save_dir}/{save_weight}_{hidden}[_moe]_resume.pth``: the state a ``--from_resume 1`` run continues."""
    weights = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    return os.path.splitext(weights)[0] + "_resume.pth"


def load_resume_state(args):
    """The resume file's state; ValueError naming each flag whose value differs from the run that wrote it."""
    state = torch.load(resume_path(args), map_location="cpu", weights_only=False)
    changed = [
        f"--{key} {state['args'][key]!r} (now {getattr(args, key)!r})"
        for key in RESUME_KEYS
        if state["args"].get(key) != getattr(args, key)
    ]
    if changed:
        raise InputError(
            f"{resume_path(args)} was written by a run with {', '.join(changed)}: resume with the "
            f"same flags, or start anew without --from_resume"
        )
    return state


def sft_loss(logits, labels):
    """Mean next-token cross-entropy over labelled positions: logits [B, T, V], labels [B, T] (-100 = skip)."""
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = labels[:, 1:]
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1), ignore_index=-100
    )


def main(argv=None):
    args = parse_args(argv)
    local_rank, device = init_distributed_mode()
    rank = dist.get_rank() if dist.is_initialized() else 0
    setup_seed(args.seed + rank)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)

    folder_start = is_model_folder(args.from_weight)  # a Qwen3ForCausalLM folder: its config.json (parse_args)
    lm_config = (
        folder_config(args.from_weight)
        if folder_start
        else build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    )
    model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, device=device)
    if args.gradient_checkpointing:  # transformers' activation checkpointing, non-reentrant
        model.activation_checkpointing_enable({"use_reentrant": False})
    dataset = SFTDataset(args.data_path, tokenizer, max_length=args.max_seq_len)
    if len(dataset) == 0:
        raise InputError(f"--data_path {args.data_path}: found 0 conversations, need at least 1")
    sampler = DistributedSampler(dataset, seed=args.seed) if dist.is_initialized() else None
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=generator,
        collate_fn=lambda b: sft_collate(b, tokenizer.pad_token_id),
    )
    total_steps = args.max_steps or args.epochs * len(loader)
    Logger(
        f"SFT: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(dataset)} samples, "
        f"{total_steps} steps"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = build_cosine_scheduler(optimizer, total_steps)
    if dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.startswith("cuda") else None)

    guard = BadStepGuard(args.max_bad_steps)
    step, first_epoch, skip_batches, start = 0, 0, 0, time.time()
    if args.from_resume:  # weights, optimizer, schedule, and the data order from the resumed epoch's start
        state = load_resume_state(args)
        unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, first_epoch, skip_batches = state["step"], state["epoch"], state["batch_in_epoch"]
        generator.set_state(state["epoch_generator_state"])
        Logger(f"resumed {resume_path(args)} at step {step}/{total_steps}")
    model.train()
    for epoch in range(first_epoch, 10**9):
        if sampler is not None:
            sampler.set_epoch(epoch)
        epoch_generator_state = generator.get_state()  # the shuffle of this epoch is drawn from here
        for batch_in_epoch, (input_ids, labels, attention_mask) in enumerate(loader, start=1):
            if epoch == first_epoch and batch_in_epoch <= skip_batches:
                continue  # trained before the resume
            input_ids, labels, attention_mask = input_ids.to(device), labels.to(device), attention_mask.to(device)
            out = model(input_ids, attention_mask=attention_mask)  # through DDP when distributed
            loss = sft_loss(out.logits, labels) + out.aux_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            step += 1
            project_scale_only_gradients(optimizer)  # no-op: SFT's AdamW has no scale-only group
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
            problems = nonfinite_parts(loss=loss.detach(), gradients=grad_norm)
            skipped = any_rank(bool(problems), device)  # a NaN or inf on any rank: no rank updates
            if not skipped:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            guard.record(step, skipped, problems)
            if step % args.log_interval == 0 or step == total_steps:
                Logger(
                    f"step {step}/{total_steps} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                    f"elapsed {time.time() - start:.0f}s"
                )
            if args.save_interval and step % args.save_interval == 0 and is_main_process():
                snapshot = weight_path(
                    f"{args.save_weight}_step{step}", args.save_dir, args.hidden_size, args.use_moe, allow_file=False
                )
                save_weights(half_state_dict(model), snapshot, tokenizer.name_or_path)
                state = {
                    "model": unwrap_model(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "batch_in_epoch": batch_in_epoch,
                    "epoch_generator_state": epoch_generator_state,
                    "args": {key: getattr(args, key) for key in RESUME_KEYS},
                }
                atomic_write({resume_path(args): lambda tmp, state=state: torch.save(state, tmp)})
            if step >= total_steps:
                break
        if step >= total_steps:
            break

    if is_main_process():
        path = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
        save_weights(half_state_dict(model), path, tokenizer.name_or_path)  # and the tokenizer they go with
        Logger(f"saved {path}")
        if folder_start:  # a folder in, a folder out (bf16 safetensors, config.json, the tokenizer)
            folder = model_folder_path(path)
            write_folder_atomically(
                folder,
                lambda tmp: write_model_folder(unwrap_model(model).state_dict(), lm_config, args.tokenizer_path, tmp),
            )
            Logger(f"saved {folder}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
