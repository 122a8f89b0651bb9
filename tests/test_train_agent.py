"""trainer/train_agent.py: the agent rewards on hand-computed cases; bad rows named by file and line before any model
is built; a 2-step run on upstream-format rows (upstream MiniMind's tokenizer, a tiny random MiniMind) whose loss
trains the model's tokens only and whose metrics rows carry the rewards, tool use and the held-out evaluation;
a run stopped by SIGTERM and resumed equal to an uninterrupted one."""

import json
import os
import re
import signal

import pytest
import torch

from conftest import MINIMIND_TOKENIZER
from run_patched import agent_text_rewards as text_rewards
from test_agent_rollout import CALC_CALL, ScriptedPolicy, turn_ids
from dataset.agent_dataset import AgentRLDataset, collate_agent_rows
from trainer import train_agent
from trainer.agent.rewards import (
    agent_reward,
    call_count_reward,
    calculate_agent_rewards,
    final_answer_text,
    gt_found,
    gt_reward,
    tag_penalty,
)
from trainer.agent.rollout import agent_rollout, ended_with_eos, template_kwargs
from trainer.agent.tools import conversation_tools, count_valid_calls, parse_tool_calls, tool_schemas
from trainer.infra.distributed import unwrap_model
from trainer.infra.metrics import mask_segments

# ----------------------------------------------------------------------------- upstream-format rows
QUESTIONS = [  # (question, tools offered, gt): rows of upstream's agent_rl.jsonl format, written for these tests
    ("帮我算一下 (45 + 27) * 3 是多少", ["calculate_math", "get_current_time"], ["216"]),
    ("北京天气怎么样？", ["get_current_weather"], ["28°C"]),
    ("100 美元能换多少人民币？", ["get_exchange_rate", "calculate_math"], ["721"]),
    ("现在东京几点了？", ["get_current_time"], ["15:30"]),
    ("Translate 'Happy birthday' into chinese.", ["translate_text"], ["生日快乐"]),
    ("12 * 12 等于多少？", ["calculate_math"], ["144"]),
    ("5 km is how many miles?", ["unit_converter"], ["3.1069"]),
    ("上海天气如何？", ["get_current_weather", "get_current_time"], ["15°C"]),
]


def upstream_row(question, tools, gt, answer="好的。"):
    """One line of upstream's agent_rl.jsonl: the system turn carries the schemas as a JSON string, then the user's
    question and a reference assistant turn (dropped from the prompt), and ``gt``."""
    schemas = json.dumps(tool_schemas(tools), ensure_ascii=False)
    return {
        "conversations": [
            {"role": "system", "content": "你是一个有用的助手。", "tools": schemas},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        "gt": gt,
    }


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_agent_files(tmp_path):
    """(save_dir with tiny_64.pth trained with upstream's tokenizer, training rows, held-out rows) under tmp_path."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config, write_tokenizer_record

    torch.manual_seed(0)
    model = MiniMindForCausalLM(build_config(hidden_size=64, num_hidden_layers=2, use_moe=0))
    save_dir = tmp_path / "out"
    save_dir.mkdir()
    torch.save({k: v.half() for k, v in model.state_dict().items()}, save_dir / "tiny_64.pth")
    write_tokenizer_record(str(save_dir / "tiny_64.pth"), MINIMIND_TOKENIZER)
    train = write_rows(tmp_path / "agent_rl.jsonl", [upstream_row(*q) for q in QUESTIONS])
    heldout = write_rows(tmp_path / "agent_rl_val.jsonl", [upstream_row(*q) for q in QUESTIONS[:2]])
    return str(save_dir), train, heldout


@pytest.fixture
def agent_files(tmp_path):
    return write_agent_files(tmp_path)


def flags(save_dir, data, run_dir, *extra):
    return [
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--from_weight",
        "tiny",
        "--tokenizer_path",
        MINIMIND_TOKENIZER,
        "--reward_model_path",
        "none",
        "--max_gen_len",
        "8",
        "--max_total_len",
        "512",
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_turns",
        "2",
        "--save_dir",
        save_dir,
        "--data_path",
        data,
        "--run_dir",
        run_dir,
        "--eval_interval",
        "0",
        *extra,
    ]


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


# ----------------------------------------------------------------------------- rewards, by hand
def test_tag_penalty_counts_each_unbalanced_tag():
    assert tag_penalty(["no call"]) == 0.0
    assert tag_penalty([CALC_CALL, "答案是 216"]) == 0.0
    assert tag_penalty(["<tool_call>{}", "</tool_call></tool_call> <tool_call>"]) == -0.5 - 0.5


def test_gt_found_as_text_or_as_an_equal_number():
    assert gt_found("结果是 216。", ["216"]) == {"216"}
    assert gt_found("结果是 216.0", ["216"]) == {"216"}  # numbers compare as numbers
    assert gt_found("1,234 元", ["1234"]) == {"1234"}  # commas removed
    assert gt_found("It is SUNNY", ["sunny", "28°C"]) == {"sunny"}  # case-insensitive text
    assert gt_found("2160", ["216.0"]) == set()  # a number inside another is not it
    assert gt_found("", ["216"]) == set()


def test_call_count_and_gt_rewards():
    assert call_count_reward(1, 1, 1) == 0.5  # one valid call for one ground-truth value
    assert call_count_reward(2, 1, 1) == -0.5  # one invalid call: gap 1
    assert call_count_reward(3, 1, 2) == -1.5  # gap |1 - 2| + (3 - 1) = 3
    assert call_count_reward(1, 1, 0) == -0.5
    assert gt_reward("216 and 15:30", ["216", "15:30"]) == 2.5
    assert gt_reward("216", ["216", "15:30"]) == 1.25
    assert gt_reward("216", []) == 0.0


TOOLS = ["calculate_math", "get_current_time"]


def call_counts(turn_texts, allowed):
    """(calls, valid calls) over the turns, as the rollout counts them: the real parser on each turn's text."""
    calls = [call for text in turn_texts for call in parse_tool_calls(text)]
    return len(calls), count_valid_calls(calls, allowed)


def reward_of(turn_texts, gt, allowed, unfinished, **kwargs):
    """agent_reward with the call counts of ``turn_texts``."""
    return agent_reward(turn_texts, gt, *call_counts(turn_texts, allowed), unfinished, **kwargs)


def test_final_text_and_call_counts():
    assert final_answer_text([CALC_CALL, "先算 <tool_call>x</tool_call> 答案 216"], unfinished=False) == " 答案 216"
    assert final_answer_text([CALC_CALL], unfinished=True) == ""
    bad_arguments = '<tool_call>{"name": "calculate_math", "arguments": {"x": 1}}</tool_call>'
    not_offered = '<tool_call>{"name": "get_current_weather", "arguments": {"location": "北京"}}</tool_call>'
    turns = [CALC_CALL + bad_arguments, not_offered + "<tool_call>not json</tool_call>"]
    assert call_counts(turns, TOOLS) == (4, 1)  # a malformed call counts as a call, not as a valid one
    assert call_counts(["216"], TOOLS) == (0, 0)


def test_agent_reward_with_a_valid_call_and_the_answer():
    # a valid call (+0.5), then the answer holding the one gt value (+2.5), no repetition -> clipped to 3.0
    parts = reward_of([CALC_CALL, "答案是 216。"], ["216"], TOOLS, unfinished=False)
    assert parts["call_reward"] == 0.5 and parts["answer_reward"] == 2.5 and parts["repetition_penalty"] == 0.0
    assert parts["reward"] == 3.0 and parts["accuracy"] == 1.0 and parts["called"] == 1.0
    assert parts["rule_reward"] == 0.0 and parts["reward_model_score"] == 0.0  # the no-call terms stay out


def test_agent_reward_unfinished_invalid_and_unbalanced():
    # an unknown tool (invalid: gap |0 - 1| + 1 = 2 -> -1.0), the conversation ends on it (-0.5, final text ""),
    # one unclosed tag in a second call turn: it is a malformed call too (gap 3 -> -1.5) and -0.5 for the tag
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    parts = reward_of([unknown], ["216"], TOOLS, unfinished=True)
    assert parts["call_reward"] == -1.0 and parts["unfinished_penalty"] == -0.5 and parts["answer_reward"] == 0.0
    assert parts["reward"] == pytest.approx(-1.5 + parts["repetition_penalty"]) and parts["accuracy"] == 0.0
    parts = reward_of([unknown, "<tool_call>"], ["216"], TOOLS, unfinished=True)
    assert parts["tag_penalty"] == -0.5 and parts["call_reward"] == -1.5
    assert parts["reward"] == pytest.approx(-0.5 - 1.5 - 0.5 + parts["repetition_penalty"])


def test_agent_reward_without_a_call_is_the_rule_reward_plus_the_reward_model():
    answer = "216 is the product of forty-five plus twenty-seven and three."  # 20..800 characters: +0.5
    parts = reward_of([answer], ["216"], TOOLS, unfinished=False, reward_model_score=1.25)
    assert parts["rule_reward"] == 0.5 and parts["reward_model_score"] == 1.25 and parts["call_reward"] == 0.0
    assert parts["reward"] == 1.75 and parts["accuracy"] == 1.0 and parts["called"] == 0.0
    assert reward_of(["hi"], ["216"], TOOLS, False, reward_model_score=-3.0)["reward"] == -3.0  # -3.5 clipped


def test_calculate_agent_rewards_scores_only_answers_without_a_call(policy):
    """Two conversations of a real rollout (scripted turns teacher-forced through a tiny policy): a direct answer,
    and a calculator call then the answer; the rewards read the rollout's own call counts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    scored = []

    class RewardModel:
        def get_scores(self, messages_list, responses):
            scored.extend(responses)
            assert all("tools" not in turn for messages in messages_list for turn in messages)
            return [1.0] * len(responses)

    messages = upstream_row(*QUESTIONS[0])["conversations"][:2]
    script = [
        [turn_ids(tokenizer, "a direct answer of 216, no tool"), turn_ids(tokenizer, CALC_CALL)],
        [turn_ids(tokenizer, "216")],
    ]
    rollout = agent_rollout(
        ScriptedPolicy(policy, script),
        tokenizer,
        [messages, messages],
        1,
        max_new_tokens=64,
        max_total_len=1024,
        max_turns=2,
    )
    assert rollout.turn_texts == [["a direct answer of 216, no tool"], [CALC_CALL, "216"]]
    assert rollout.num_tool_calls.tolist() == [0, 1] and rollout.num_valid_calls.tolist() == [0, 1]
    parts = calculate_agent_rewards([messages, messages], rollout, [["216"], ["216"]], RewardModel(), 2.5)
    assert scored == ["a direct answer of 216, no tool"]
    assert parts["reward_model_scores"].tolist() == [1.0, 0.0]
    assert parts["rewards"].tolist() == [pytest.approx(0.5 + 1.0), 3.0] and parts["called"].tolist() == [0.0, 1.0]


# ----------------------------------------------------------------------------- bad input, named
@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "gt": ["1"]},
            "no system turn with 'tools'",
        ),
        ({k: v for k, v in upstream_row(*QUESTIONS[0]).items() if k != "gt"}, "expected 'gt'"),
        (
            dict(
                upstream_row(*QUESTIONS[0]),
                conversations=[
                    {
                        "role": "system",
                        "content": "s",
                        "tools": json.dumps(
                            [
                                {
                                    "type": "function",
                                    "function": {
                                        "name": "launch_rocket",
                                        "parameters": {"type": "object", "properties": {}},
                                    },
                                }
                            ]
                        ),
                    },
                    {"role": "user", "content": "q"},
                ],
            ),
            "unknown tools ['launch_rocket']",
        ),
        (
            dict(
                upstream_row(*QUESTIONS[0]),
                conversations=[
                    {"role": "system", "content": "s", "tools": "[{'type': 1"},
                    {"role": "user", "content": "q"},
                ],
            ),
            "tools are not JSON",
        ),
    ],
)
def test_bad_rows_are_named_by_file_and_line_before_any_model(agent_files, tmp_path, row, message, monkeypatch):
    save_dir, train, _ = agent_files
    rows = [upstream_row(*QUESTIONS[0]), row]
    data = write_rows(tmp_path / "bad.jsonl", rows)
    monkeypatch.setattr(train_agent, "load_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{re.escape(message)}"):
        train_agent.main(flags(save_dir, data, str(tmp_path / "run")))


# ----------------------------------------------------------------------------- runs
def test_mask_segments_split_the_runs_of_a_mask(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    ids = tokenizer("ab cd", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    segments = mask_segments(tokenizer, ids, [0] * (len(ids) - 1) + [1])
    assert [m for m, _ in segments] == [0, 1] and segments[1][1] == "<|im_end|>"


def test_two_steps_on_upstream_rows_train_the_models_tokens_only(
    agent_files, tmp_path, monkeypatch, capsys, restore_signals
):
    """Each conversation's first turn is a scripted calculator call (teacher-forced through the policy), the second
    sampled: the loss gets the rollout's mask, 1 on both turns and 0 on the tool reply between them."""
    save_dir, _, heldout = agent_files
    real_rollout, real_loss = train_agent.agent_rollout, train_agent.family_loss
    seen = {"rollouts": [], "masks": []}

    def scripted_rollout(model, tokenizer, conversations, num_generations, **kwargs):
        if kwargs.get("generator") is not None:  # the held-out evaluation: the policy as it is
            return real_rollout(model, tokenizer, conversations, num_generations, **kwargs)
        script = [[turn_ids(tokenizer, CALC_CALL)] * (len(conversations) * num_generations)]
        result = real_rollout(
            ScriptedPolicy(unwrap_model(model), script), tokenizer, conversations, num_generations, **kwargs
        )
        seen["rollouts"].append(result)
        return result

    def recording_loss(*args, **kwargs):
        seen["masks"].append(args[4])
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train_agent, "agent_rollout", scripted_rollout)
    monkeypatch.setattr(train_agent, "family_loss", recording_loss)
    run_dir = tmp_path / "run"
    calculator_rows = write_rows(
        tmp_path / "calc.jsonl", [upstream_row(q, ["calculate_math"], gt) for q, _, gt in QUESTIONS[:4]]
    )
    train_agent.main(
        flags(
            save_dir,
            calculator_rows,
            str(run_dir),
            "--max_steps",
            "2",
            "--max_gen_len",
            "48",
            "--eval_interval",
            "2",
            "--eval_data_path",
            heldout,
            "--eval_num_prompts",
            "2",
            "--debug_mode",
            "1",
            "--debug_interval",
            "1",
        )
    )
    assert len(seen["rollouts"]) == 2 and len(seen["masks"]) == 2
    for rollout, mask in zip(seen["rollouts"], seen["masks"]):
        assert torch.equal(mask, rollout.completion_mask)
        real = rollout.attention_mask[:, -mask.size(1) :]  # [N, R]
        assert ((real == 1) & (mask == 0)).any(dim=1).all()  # every conversation has a tool reply, not trained
        assert (rollout.num_turns == 2).all() and (rollout.num_valid_calls == 1).all()
        assert (rollout.old_per_token_logps[mask == 0] == 0).all()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in (
        "reward",
        "rule_reward",
        "reward_model_score",
        "call_reward",
        "answer_reward",
        "tag_penalty",
        "accuracy",
        "tool_call_share",
        "valid_call_share",
        "turns",
        "policy_loss",
        "kl_ref",
        "entropy",
    ):
        assert all(key in row for row in rows[1:]), key
    assert rows[1]["tool_call_share"] == 1.0 and rows[1]["valid_call_share"] == 1.0 and rows[1]["turns"] == 2.0
    assert rows[1]["call_reward"] == 0.5  # one valid call for one gt value in every conversation
    # the first update's policy is the sampler: the rollout's old log-probs equal the loss's forward on every
    # trained token (a tool reply wrongly trained would hold old log-prob 0 and a ratio far from 1)
    assert abs(rows[1]["ratio_min"] - 1) < 1e-4 and abs(rows[1]["ratio_max"] - 1) < 1e-4
    for row in (rows[0], rows[2]):  # the held-out evaluation before and after
        assert {
            f"eval/{key}_{kind}"
            for key in ("accuracy", "tool_call_share", "answers_with_valid_call", "valid_call_share", "turns")
            for kind in ("sampled", "greedy")
        } <= set(row)
        for kind in ("sampled", "greedy"):  # an answer with a valid call is an answer with a call
            assert row[f"eval/answers_with_valid_call_{kind}"] <= row[f"eval/tool_call_share_{kind}"]
    out = capsys.readouterr().out
    assert "[mask 1: trained]" in out and "[mask 0: not trained]" in out and '{"result": "216"}' in out
    assert "held-out agent evaluation on 2 prompts" in out
    assert os.path.isfile(os.path.join(save_dir, "agent_64.pth"))


@pytest.mark.parametrize("lora", [[], ["--lora_rank", "4"]])
def test_a_resumed_run_equals_an_uninterrupted_one(lora, agent_files, tmp_path, restore_signals):
    """4 steps straight; 4 steps stopped by SIGTERM during step 2 (saved at its end), then resumed: steps 3-4 log the
    same numbers and end in the same weights (with LoRA: the merged weights)."""
    save_dir, train, _ = agent_files
    calls = {"n": 0}

    def stopping_rewards(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a stop request: honoured at the end of step 2
        return text_rewards(*args)

    runs = {}
    for name in ("straight", "resumed"):
        folder = tmp_path / name
        folder.mkdir()
        for file in ("tiny_64.pth", "tiny_64.tokenizer.json"):
            (folder / file).write_bytes(open(os.path.join(save_dir, file), "rb").read())
        argv = flags(str(folder), train, str(folder / "run"), "--max_steps", "4", "--save_interval", "10") + lora
        if name == "straight":
            train_agent.main(argv, reward_fn=text_rewards)
        else:
            train_agent.main(argv, reward_fn=stopping_rewards)
            assert [row["step"] for row in read_jsonl(folder / "run" / "metrics.jsonl")] == [1, 2]
            train_agent.main(argv + ["--from_resume", "1"], reward_fn=text_rewards)
        runs[name] = folder
    straight, resumed = (read_jsonl(runs[n] / "run" / "metrics.jsonl") for n in ("straight", "resumed"))
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in ("reward", "policy_loss", "kl_ref", "entropy", "turns", "response_len", "sample_indices"):
            assert a[key] == b[key], (a["step"], key)
    weights = [torch.load(runs[n] / "agent_64.pth", weights_only=True) for n in ("straight", "resumed")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(
        torch.equal(weights[0][k], v.half())
        for k, v in torch.load(os.path.join(save_dir, "tiny_64.pth"), weights_only=True).items()
    )


def test_ended_with_eos_reads_the_last_model_token_only():
    """--mask_truncated_completions: a conversation whose last model turn was cut (no EOS) leaves the loss; EOS in an
    observation (mask 0) or in an earlier turn does not count."""
    from types import SimpleNamespace

    eos = 2
    completion_ids = torch.tensor(
        [
            [5, eos, 7, 8, 9, eos, 0],  # turn, reply, turn ending in EOS
            [5, eos, 7, eos, 9, 9, 0],  # turn, reply (EOS inside it), turn cut
            [5, 6, 0, 0, 0, 0, 0],
        ]
    )  # one turn, cut
    completion_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]])
    rollout = SimpleNamespace(completion_ids=completion_ids, completion_mask=completion_mask)
    assert ended_with_eos(rollout, eos).tolist() == [True, False, False]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--top_k", "5"], "--top_k 0"),
        (["--top_p", "0.9"], "--top_p 1.0"),
        (["--thinking_ratio", "1.5"], "--thinking_ratio must be in [0, 1]"),
        (["--max_total_len", "8"], "--max_total_len must be"),
        (["--max_turns", "0"], "--max_turns must be >= 1"),
    ],
)
def test_flags_the_agent_rollout_cannot_honour_are_refused(agent_files, tmp_path, extra, message, capsys):
    save_dir, train, _ = agent_files
    with pytest.raises(SystemExit):
        train_agent.parse_args(flags(save_dir, train, str(tmp_path / "run"), *extra))
    assert message in capsys.readouterr().err


def test_thinking_opens_per_prompt_as_the_chapters_dataset_draws_it(agent_files, policy):
    """--thinking_ratio 0.5: each prompt opens thinking as ``RLAIFDataset`` (train_grpo.py's) draws it for the same
    seed and row, and the rollout renders every prompt with its own draw."""
    from transformers import AutoTokenizer
    from dataset.lm_dataset import RLAIFDataset

    _, train, _ = agent_files
    tokenizer = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    rlaif = RLAIFDataset(train, tokenizer, thinking_ratio=0.5, seed=7)
    agent = AgentRLDataset(train, tokenizer, thinking_ratio=0.5, seed=7, check_tools=conversation_tools)
    opened = [rlaif[i]["prompt"].endswith("<think>\n") for i in range(len(rlaif))]
    assert 0 < sum(opened) < len(opened)  # both kinds among the rows
    batch = collate_agent_rows([agent[i] for i in range(len(agent))])
    assert batch["open_thinking"] == opened
    result = agent_rollout(
        policy,
        tokenizer,
        batch["messages"],
        1,
        max_new_tokens=2,
        max_total_len=512,
        chat_template_kwargs=template_kwargs(batch["open_thinking"]),
    )
    prompt_width = result.output_ids.size(1) - result.completion_ids.size(1)
    prompts = [
        tokenizer.decode(result.output_ids[n, :prompt_width][result.prompt_mask[n].bool()]) for n in range(len(opened))
    ]
    assert [prompt.endswith("<think>\n") for prompt in prompts] == opened


def test_reinforce_pp_returns_carry_across_the_tool_reply(agent_files, tmp_path, monkeypatch, restore_signals):
    """--advantage_estimator reinforce_pp on scripted two-turn conversations (a call, the tool's reply with mask 0,
    an answer): with gamma 1 and the KL in the loss every model token of a conversation, before and after the reply,
    gets its answer's return, whitened over every model token of the batch (a plain computation here)."""
    save_dir, _, _ = agent_files
    real_rollout, real_loss = train_agent.agent_rollout, train_agent.family_loss
    seen = {"advantages": [], "masks": [], "rewards": []}

    def scripted_rollout(model, tokenizer, conversations, num_generations, **kwargs):
        script = [[turn_ids(tokenizer, CALC_CALL)] * (len(conversations) * num_generations)]
        return real_rollout(
            ScriptedPolicy(unwrap_model(model), script), tokenizer, conversations, num_generations, **kwargs
        )

    def recording_rewards(*args):
        parts = text_rewards(*args)
        seen["rewards"].append(parts["rewards"])
        return parts

    def recording_loss(*args, **kwargs):
        seen["advantages"].append(args[3])
        seen["masks"].append(args[4])
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train_agent, "agent_rollout", scripted_rollout)
    monkeypatch.setattr(train_agent, "family_loss", recording_loss)
    calculator_rows = write_rows(
        tmp_path / "calc.jsonl", [upstream_row(q, ["calculate_math"], gt) for q, _, gt in QUESTIONS[:4]]
    )
    train_agent.main(
        flags(
            save_dir,
            calculator_rows,
            str(tmp_path / "run"),
            "--max_steps",
            "1",
            "--max_gen_len",
            "48",
            "--advantage_estimator",
            "reinforce_pp",
            "--kl_placement",
            "loss",
        ),
        reward_fn=recording_rewards,
    )
    advantages, mask, rewards = seen["advantages"][0], seen["masks"][0], seen["rewards"][0]
    assert advantages.shape == mask.shape  # [B*G, R]: one advantage per token
    tokens = [float(r) for r, row in zip(rewards, mask) for _ in range(int(row.sum()))]  # each model token's return
    mean = sum(tokens) / len(tokens)
    std = (sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1) + 1e-8) ** 0.5
    for row in range(mask.size(0)):
        model_tokens = mask[row].nonzero().flatten()
        assert (model_tokens.diff() > 1).any()  # the tool's reply lies between the two turns
        expected = (float(rewards[row]) - mean) / std
        assert advantages[row, model_tokens].tolist() == pytest.approx([expected] * len(model_tokens), abs=1e-5)
        assert (advantages[row][mask[row] == 0] == 0).all()
