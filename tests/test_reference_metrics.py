"""Behaviour pin for refactors: `--max_steps 5` of both RL scripts gives the recorded metrics.jsonl, bit for bit.

The files in tests/reference_metrics/ were written by this module (``python tests/test_reference_metrics.py``).
The first pin came from the code before the run harness was split out of train_grpo.py (an AVX2 machine); the
present one was recorded when the optimizers moved to AdamW's fused kernel (``trainer_utils.adamw``), which
rounds a few operations differently (7th-digit changes of losses and norms; rewards, lengths and held-out
accuracy unchanged), on an AVX512 machine after checking there that the code before that change still gave the
old numbers bit for bit. Every number of every line (key order included) must stay the same; only
``elapsed_s`` (wall time) is left out.

GRPO's pin runs ``--shared_prefix 0`` (every answer with its own copy of the prompt), the layout of the first
recording: the shared-prefix forward computes the same log-probs to the last bits or so (other matrix shapes pick
other summation orders; tests/test_forward_layouts.py checks it to 1e-5), which a bit-for-bit pin cannot tell
from a change in behaviour.

Float results depend on the CPU's vector unit (AVX2, AVX512, AMX pick different kernels) and on the torch
release, so the comparison runs where both match the recording (reference_metrics/machine.json), and is
skipped with the reason elsewhere; recording again there gives a new pin.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_DIR = os.path.join(ROOT, "tests", "reference_metrics")
TIMING_KEYS = ("elapsed_s",)


def machine():
    """What the float results depend on: the torch release and the CPU's vector unit."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


PADDED_LAYOUT = {"grpo": ["--shared_prefix", "0"], "ppo": []}


def run_five_steps(script, work_dir):
    """`python trainer/train_{script}.py --max_steps 5` in the padded layout (``PADDED_LAYOUT``; defaults
    otherwise, one thread), written under work_dir; returns the metrics.jsonl lines as dicts without the timing
    keys."""
    run_dir = os.path.join(work_dir, "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    command = [sys.executable, os.path.join(ROOT, "trainer", f"train_{script}.py"), "--max_steps", "5",
               *PADDED_LAYOUT[script], "--save_dir", work_dir, "--run_dir", run_dir]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def recorded_machine():
    with open(os.path.join(REFERENCE_DIR, "machine.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_five_steps_match_the_recorded_metrics(script, tmp_path):
    recorded = recorded_machine()
    if recorded != machine():
        pytest.skip(f"reference recorded with {recorded}, this machine is {machine()}: float kernels differ")
    with open(os.path.join(REFERENCE_DIR, f"{script}.jsonl"), encoding="utf-8") as f:
        expected = [json.loads(line) for line in f]
    rows = run_five_steps(script, str(tmp_path))
    assert len(rows) == len(expected) == 6  # step 0 (evaluation) and steps 1-5
    for row, expected_row in zip(rows, expected):
        assert list(row) == list(expected_row), f"step {expected_row['step']}: keys differ"
        for key in expected_row:
            where = f"step {expected_row['step']} {key}"
            assert row[key] == expected_row[key], f"{where}: {row[key]!r} != {expected_row[key]!r}"


if __name__ == "__main__":  # record the pin on this machine
    import tempfile
    os.makedirs(REFERENCE_DIR, exist_ok=True)
    for name in ("grpo", "ppo"):
        with tempfile.TemporaryDirectory() as tmp:
            lines = [json.dumps(row) for row in run_five_steps(name, tmp)]
        with open(os.path.join(REFERENCE_DIR, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    with open(os.path.join(REFERENCE_DIR, "machine.json"), "w", encoding="utf-8") as f:
        json.dump(machine(), f)
        f.write("\n")
