"""A digest of a model's weights, for tests that compare weights across processes and checkpoints."""

import hashlib

import torch

from trainer.infra.distributed import unwrap_model
from trainer.infra.fsdp import full_tensor


def parameter_digest(model):
    """sha256 over every state-dict entry's name and bytes: equal digests mean bit-identical weights. A model sharded
    by ``--fsdp 1`` is digested whole (every rank gathers every tensor: a collective)."""
    digest = hashlib.sha256()
    for name, param in unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        digest.update(full_tensor(param).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
