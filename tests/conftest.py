import os
import signal
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "tests", "support")  # the tests' helper modules and the workers they start
for path in (ROOT, SUPPORT):
    if path not in sys.path:
        sys.path.insert(0, path)

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N processes share the cores; one thread each, no contention
    torch.set_num_threads(1)

SHARED = os.path.join(os.path.dirname(ROOT), "shared")
# Third-party files the tests read, each with its licence beside it (tests/fixtures/README.md).
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MINIMIND_TOKENIZER = os.path.join(FIXTURES, "minimind-tokenizer")
TEST_REQUIREMENTS = "pip install -r requirements-test.txt"


def require_trl():
    """The ``trl`` module (TRL, the tests' independent reference); a clear error where it is not installed."""
    try:
        import trl
    except ImportError as error:
        raise ImportError(f"these tests compare against TRL, which is not installed: {TEST_REQUIREMENTS}") from error
    return trl


@pytest.fixture
def tiny_config():
    from model.model_minimind import MiniMindConfig

    return MiniMindConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=6400
    )


@pytest.fixture
def policy():
    """A random dense MiniMind of hidden 64 x 2 layers (the scripts' build_config), init std 0.1 so that its
    log-probs differ visibly between tokens; seed 0."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config

    torch.manual_seed(0)
    config = build_config(hidden_size=64, num_hidden_layers=2, use_moe=0)
    config.initializer_range = 0.1
    return MiniMindForCausalLM(config)


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


@pytest.fixture
def tiny_weights(tmp_path):
    """A random MiniMind of the scripts' flags --hidden_size 64 --num_hidden_layers 2, saved as {tmp}/tiny_64.pth
    (MiniMind naming) with the record of the bundled tokenizer beside it (tiny_64.tokenizer.json), as the scripts
    save weights; returns (save_dir, name)."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import write_tokenizer_record
    from trainer.infra.weights import build_config

    torch.manual_seed(0)
    model = MiniMindForCausalLM(build_config(hidden_size=64, num_hidden_layers=2, use_moe=0))
    torch.save({k: v.half() for k, v in model.state_dict().items()}, tmp_path / "tiny_64.pth")
    write_tokenizer_record(str(tmp_path / "tiny_64.pth"), os.path.join(ROOT, "model"))  # as the scripts save it
    return str(tmp_path), "tiny"


@pytest.fixture
def small_data(tmp_path):
    """The first 48 prompts of the bundled RL data, as {tmp}/rl_small.jsonl (fast start-up for script runs)."""
    lines = open(os.path.join(ROOT, "dataset", "rlaif_train.jsonl"), encoding="utf-8").read().splitlines()[:48]
    path = tmp_path / "rl_small.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture
def restore_signals():
    """SIGTERM and SIGINT back to their defaults after a test that ran a training main in this process."""
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
