"""trainer/agent/rollout.py: the masks of a two-turn conversation against the rendered chat template, token by token;
the tools' replies in the observations; old log-probs equal to a fresh forward over the whole conversation; the loss
with the observations masked equal to TRL 1.16's ``_compute_loss`` with a ``tool_mask``; cutting at max_total_len;
the re-tokenisation check; bad input named. Upstream's tokenizer (tests/fixtures) and a tiny random MiniMind."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from conftest import MINIMIND_TOKENIZER, require_trl
from test_grpo_family import config_of, trl_trainer
from trainer.agent.rollout import agent_rollout, conversation_tools
from trainer.agent.tools import execute_tool, tool_schemas
from trainer.grpo_family import family_loss
from trainer.rollout_engine import compute_per_token_logps

CALC_CALL = '<tool_call>\n{"name": "calculate_math", "arguments": {"expression": "(45 + 27) * 3"}}\n</tool_call>'
WEATHER_CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "北京"}}\n</tool_call>'
ANSWER = "(45 + 27) * 3 = 216。"
MODEL_TURN_HEADER = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the generation prompt without open_thinking
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tokenizer():
    """Upstream MiniMind's tokenizer with its tools chat template."""
    return AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)


def upstream_row(question, tool_names):
    """The prompt turns of an upstream ``agent_rl.jsonl`` row: the system turn carries the schemas as a JSON string."""
    tools = json.dumps(tool_schemas(tool_names), ensure_ascii=False)
    return [
        {"role": "system", "content": "你是一个有用的助手。", "tools": tools},
        {"role": "user", "content": question},
    ]


CALC_ROW = upstream_row("帮我算一下 (45 + 27) * 3 是多少", ["calculate_math", "get_current_time"])
WEATHER_ROW = upstream_row("北京天气怎么样？", ["get_current_weather"])


class ScriptedPolicy(torch.nn.Module):
    """A stand-in for the policy whose ``generate`` writes scripted turns, teacher-forced through the real policy
    (their log-probs are the policy's at the temperature), and samples from the policy once the script is used up.
    script: per ``generate`` call, one list of token ids per active row, or None to sample."""

    def __init__(self, policy, script):
        super().__init__()
        self.policy = policy
        self.script = list(script)

    def forward(self, *args, **kwargs):
        return self.policy(*args, **kwargs)

    def generate(self, input_ids, attention_mask, max_new_tokens, temperature, eos_token_id, pad_token_id, **sampling):
        turns = self.script.pop(0) if self.script else None
        if turns is None:
            return self.policy.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                **sampling,
            )
        assert len(turns) == input_ids.size(0)
        turns = [ids[:max_new_tokens] for ids in turns]
        width = max(len(ids) for ids in turns)
        forced = torch.full((len(turns), width), pad_token_id, dtype=torch.long)  # [A, T]
        forced_mask = torch.zeros((len(turns), width), dtype=torch.long)  # [A, T]
        for row, ids in enumerate(turns):
            forced[row, : len(ids)] = torch.tensor(ids)
            forced_mask[row, : len(ids)] = 1
        output_ids = torch.cat([input_ids, forced], dim=1)  # [A, L + T]
        per_token_logps = compute_per_token_logps(
            self.policy, output_ids, width, torch.cat([attention_mask, forced_mask], dim=1), temperature
        ).per_token_logps  # [A, T]
        return output_ids, per_token_logps * forced_mask


def turn_ids(tokenizer, text):
    """A model turn as the model writes it: the text's tokens, then EOS (<|im_end|>)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def real_tokens(result, n):
    """Row n's tokens without padding, with their completion mask (0 on the prompt)."""
    keep = result.attention_mask[n].bool()
    prompt_width = result.output_ids.size(1) - result.completion_ids.size(1)
    mask = torch.cat([torch.zeros(prompt_width, dtype=torch.long), result.completion_mask[n].cpu()])
    return result.output_ids[n][keep].tolist(), mask[keep].tolist()


def observations(tokenizer, result, n):
    """The texts of row n's runs of completion tokens that are real but not the model's (its observations)."""
    ids = result.completion_ids[n].tolist()
    is_observation = ((result.completion_mask[n] == 0) & (result.attention_mask[n, -len(ids) :] == 1)).tolist()
    runs, current = [], []
    for token, flag in zip(ids, is_observation):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs + ([current] if current else [])]


def batched_rollout(policy, tokenizer, **overrides):
    """Two upstream rows x 2 generations; turn 1 scripted (a calculator call, a direct answer, a weather call, a
    call to a tool the row does not offer), turn 2 sampled from the policy for the three rows still active."""
    script = [[turn_ids(tokenizer, text) for text in (CALC_CALL, ANSWER, WEATHER_CALL, CALC_CALL)]]
    settings = dict(
        max_new_tokens=40,
        max_total_len=1024,
        temperature=TEMPERATURE,
        max_turns=3,
        generator=torch.Generator().manual_seed(0),
    )
    settings.update(overrides)
    return agent_rollout(ScriptedPolicy(policy, script), tokenizer, [CALC_ROW, WEATHER_ROW], 2, **settings)


def test_masks_of_a_two_turn_conversation_follow_the_rendered_template(policy, tokenizer):
    """A tool call, the tool's reply, an answer: the tokens are the template's rendering of that conversation and
    exactly the model's two turns (each through its <|im_end|>) have mask 1."""
    script = [[turn_ids(tokenizer, CALC_CALL)], [turn_ids(tokenizer, ANSWER)]]
    result = agent_rollout(
        ScriptedPolicy(policy, script),
        tokenizer,
        [CALC_ROW],
        1,
        max_new_tokens=64,
        max_total_len=1024,
        temperature=TEMPERATURE,
    )
    messages, tools = conversation_tools(CALC_ROW)
    reply = execute_tool("calculate_math", {"expression": "(45 + 27) * 3"})
    assert reply == '{"result": "216"}'
    messages += [
        {"role": "assistant", "content": CALC_CALL},
        {"role": "tool", "content": reply},
        {"role": "assistant", "content": ANSWER},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")  # the template's newline after the last turn is not generated
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    tokens, mask = real_tokens(result, 0)
    assert encoded["input_ids"][:-1] == tokens and tokenizer.decode(encoded["input_ids"][-1:]) == "\n"

    spans, position = [], 0
    for _ in range(2):  # each model turn: from after its generation prompt through its <|im_end|>
        start = rendered.index(MODEL_TURN_HEADER, position) + len(MODEL_TURN_HEADER)
        position = rendered.index("<|im_end|>", start) + len("<|im_end|>")
        spans.append((start, position))
    expected = [int(any(s <= a and b <= e for s, e in spans)) for a, b in encoded["offset_mapping"][:-1]]
    assert mask == expected
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert trained == CALC_CALL + "<|im_end|>" + ANSWER + "<|im_end|>"
    assert observations(tokenizer, result, 0) == [
        "\n<|im_start|>user\n<tool_response>\n" + reply + "\n</tool_response><|im_end|>\n" + MODEL_TURN_HEADER
    ]
    assert result.old_per_token_logps[result.completion_mask == 0].abs().max() == 0
    assert (result.old_per_token_logps[result.completion_mask == 1] < 0).all()
    assert (result.num_turns.tolist(), result.num_tool_calls.tolist(), result.num_valid_calls.tolist()) == (
        [2],
        [1],
        [1],
    )
    assert result.final_answers == [ANSWER] and result.turn_texts == [[CALC_CALL, ANSWER]]
    assert not result.unfinished[0] and result.metrics["prefix_mismatches"] == 0


def test_a_tool_call_gets_the_tools_reply_and_the_batch_advances_together(policy, tokenizer):
    rows_before = json.dumps([CALC_ROW, WEATHER_ROW])
    result = batched_rollout(policy, tokenizer)
    assert json.dumps([CALC_ROW, WEATHER_ROW]) == rows_before  # the caller's conversations are not changed
    assert result.output_ids.shape[0] == 4 and result.completion_mask.shape == result.completion_ids.shape
    assert result.num_turns.tolist() == [2, 1, 2, 2]  # row 1 answered without a call and left the batch
    assert result.num_tool_calls.tolist() == [1, 0, 1, 1]
    assert result.num_valid_calls.tolist() == [1, 0, 1, 0]  # row 3 called a tool its row does not offer
    calc_reply = execute_tool("calculate_math", {"expression": "(45 + 27) * 3"})
    weather_reply = execute_tool("get_current_weather", {"location": "北京"})
    assert "216" in calc_reply and "北京" in weather_reply
    wrapped = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n" + MODEL_TURN_HEADER
    assert observations(tokenizer, result, 0) == [wrapped.format(calc_reply)]
    assert observations(tokenizer, result, 1) == []
    assert observations(tokenizer, result, 2) == [wrapped.format(weather_reply)]
    (not_offered,) = observations(tokenizer, result, 3)
    assert '"error"' in not_offered and "not offered" in not_offered
    assert result.final_answers[1] == ANSWER
    assert [texts[0] for texts in result.turn_texts] == [CALC_CALL, ANSWER, WEATHER_CALL, CALC_CALL]
    assert not result.unfinished.any() and result.metrics["prefix_mismatches"] == 0


@pytest.mark.parametrize("scripted", [True, False])
def test_old_log_probs_equal_a_fresh_forward_of_the_whole_conversation(policy, tokenizer, scripted):
    """Scripted first turns then sampled turns in a left-padded batch of three; or every turn sampled."""
    if scripted:
        result = batched_rollout(policy, tokenizer)
    else:
        result = agent_rollout(
            policy,
            tokenizer,
            [CALC_ROW, WEATHER_ROW],
            2,
            max_new_tokens=12,
            max_total_len=1024,
            temperature=TEMPERATURE,
            generator=torch.Generator().manual_seed(1),
        )
    width = result.completion_ids.size(1)
    fresh = compute_per_token_logps(
        policy, result.output_ids, width, result.attention_mask, TEMPERATURE
    ).per_token_logps  # [N, R]
    mask = result.completion_mask.bool()
    assert mask.sum() > 20 and (result.attention_mask[:, -width:].bool() & ~mask).any() == scripted
    assert (fresh[mask] - result.old_per_token_logps[mask]).abs().max() < 1e-5
    assert policy.training  # the rollout restores the mode it found


def test_loss_with_observations_masked_equals_trls_compute_loss_with_tool_mask(policy, tokenizer):
    """TRL multiplies its completion_mask (every real completion token) by tool_mask (0 on tool tokens): the family's
    loss on the rollout's completion_mask gives the same loss and gradient, and none reaches an observation."""
    trl = require_trl()
    result = batched_rollout(policy, tokenizer)
    width = result.completion_ids.size(1)
    prompt_width = result.output_ids.size(1) - width
    with torch.no_grad():
        fresh = compute_per_token_logps(
            policy, result.output_ids, width, result.attention_mask, TEMPERATURE
        ).per_token_logps  # [N, R]
    generator = torch.Generator().manual_seed(5)
    mask = result.completion_mask
    old = result.old_per_token_logps + 0.3 * torch.randn(fresh.shape, generator=generator) * mask  # ratios off 1
    ref = fresh + 0.3 * torch.randn(fresh.shape, generator=generator)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    tool_tokens = (result.attention_mask[:, prompt_width:] == 1) & (mask == 0)
    assert tool_tokens.sum() > 30

    for loss_type, epsilon_high in (("grpo", 0.2), ("dapo", 0.28)):

        def trl_loss(inputs_extra):
            trainer = trl_trainer(loss_type, 0.2, epsilon_high, 0.1)
            logps = fresh.clone().requires_grad_(True)
            trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
            inputs = {
                "prompt_ids": result.output_ids[:, :prompt_width],
                "prompt_mask": result.prompt_mask,
                "completion_ids": result.completion_ids,
                "completion_mask": result.attention_mask[:, prompt_width:],
                "advantages": advantages,
                "old_per_token_logps": old,
                "ref_per_token_logps": ref,
                **inputs_extra,
            }
            loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
            loss.backward()
            return loss.detach(), logps.grad

        expected_loss, expected_grad = trl_loss({"tool_mask": mask, "num_items_in_batch": mask.sum().float()})
        logps = fresh.clone().requires_grad_(True)
        loss, _, _ = family_loss(logps, old, ref, advantages, mask, config_of(loss_type, 0.2, epsilon_high, 0.1))
        loss.backward()
        assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6), loss_type
        assert torch.allclose(logps.grad, expected_grad, atol=1e-7), loss_type
        assert logps.grad[tool_tokens].abs().max() == 0 and logps.grad[mask.bool()].abs().max() > 0
        unmasked_loss, _ = trl_loss({"num_items_in_batch": result.attention_mask[:, prompt_width:].sum().float()})
        assert abs(unmasked_loss.item() - loss.item()) > 1e-3  # without tool_mask TRL trains the tools' tokens too


def test_long_conversations_stop_at_max_total_len_and_nothing_after_the_prompt_is_cut(policy, tokenizer):
    messages, tools = conversation_tools(CALC_ROW)
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    call = turn_ids(tokenizer, CALC_CALL)
    full = agent_rollout(
        ScriptedPolicy(policy, [[call]]),
        tokenizer,
        [CALC_ROW],
        1,
        max_new_tokens=len(call),
        max_total_len=1024,
        temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(2),
    )
    observation_len = int(full.attention_mask[0].sum()) - prompt_len - int(full.completion_mask[0].sum())
    assert full.output_ids.size(1) - full.completion_ids.size(1) == prompt_len and observation_len > 20

    def run(max_total_len, max_new_tokens):
        result = agent_rollout(
            ScriptedPolicy(policy, [[call, call]]),
            tokenizer,
            [CALC_ROW],
            2,
            max_new_tokens=max_new_tokens,
            max_total_len=max_total_len,
            temperature=TEMPERATURE,
            generator=torch.Generator().manual_seed(3),
        )
        assert (result.attention_mask.sum(dim=1) <= max_total_len).all()
        width = result.completion_ids.size(1)
        fresh = compute_per_token_logps(
            policy, result.output_ids, width, result.attention_mask, TEMPERATURE
        ).per_token_logps
        mask = result.completion_mask.bool()
        assert (fresh[mask] - result.old_per_token_logps[mask]).abs().max() < 1e-5
        return result

    # the observation does not fit: the conversation ends after the call, unfinished, nothing cut
    no_room = run(prompt_len + len(call) + 5, len(call) + 2)
    assert no_room.unfinished.all() and no_room.num_turns.tolist() == [1, 1]
    assert no_room.metrics["length_stops"] == 2 and no_room.metrics["prompts_cut"] == 0
    assert (no_room.attention_mask.sum(dim=1) == prompt_len + len(call)).all()
    # the observation fits with 3 tokens to spare: the second turn stops at max_total_len
    tight = prompt_len + len(call) + observation_len + 3
    second_turn_cut = run(tight, len(call) + 2)
    assert second_turn_cut.num_turns.tolist() == [2, 2] and second_turn_cut.metrics["length_stops"] == 2
    assert (second_turn_cut.attention_mask.sum(dim=1) == tight).all()
    assert (second_turn_cut.completion_mask.sum(dim=1) == len(call) + 3).all()
    # a prompt longer than max_total_len - max_new_tokens loses its first tokens, and only those
    prompt_cut = run(prompt_len - 3 + 8, 8)
    assert prompt_cut.metrics["prompts_cut"] == 2
    first_prompt = full.output_ids[0, :prompt_len]
    assert torch.equal(prompt_cut.output_ids[0, : prompt_len - 3], first_prompt[3:])


def test_a_split_that_bpe_would_merge_is_counted_and_the_models_tokens_are_kept(policy, tokenizer):
    """The call's JSON written one character per token: the text is the same, its re-tokenisation is not."""
    body = CALC_CALL[len("<tool_call>") : -len("</tool_call>")]
    split = (
        tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]
        + [i for ch in body for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
        + turn_ids(tokenizer, "</tool_call>")
    )
    assert tokenizer.decode(split[:-1]) == CALC_CALL and len(split) > len(turn_ids(tokenizer, CALC_CALL))
    result = agent_rollout(
        ScriptedPolicy(policy, [[split], [turn_ids(tokenizer, ANSWER)]]),
        tokenizer,
        [CALC_ROW],
        1,
        max_new_tokens=128,
        max_total_len=1024,
        temperature=TEMPERATURE,
    )
    assert result.metrics["prefix_mismatches"] == 1 and result.num_valid_calls.tolist() == [1]
    assert result.completion_ids[0, : len(split)].tolist() == split
    width = result.completion_ids.size(1)
    fresh = compute_per_token_logps(
        policy, result.output_ids, width, result.attention_mask, TEMPERATURE
    ).per_token_logps
    mask = result.completion_mask.bool()
    assert (fresh[mask] - result.old_per_token_logps[mask]).abs().max() < 1e-5


@pytest.mark.parametrize(
    "chat_template_kwargs, first_turn, mismatches, next_header",
    [
        ({"open_thinking": True}, "先算括号。\n</think>\n\n" + CALC_CALL, 0, "<|im_start|>assistant\n<think>\n"),
        ({}, "\n" + CALC_CALL, 1, MODEL_TURN_HEADER),  # the template strips the turn's leading newline
    ],
)
def test_template_arguments_reach_the_template_and_a_rewritten_turn_is_counted(
    policy, tokenizer, chat_template_kwargs, first_turn, mismatches, next_header
):
    script = [[turn_ids(tokenizer, first_turn)], [turn_ids(tokenizer, ANSWER)]]
    result = agent_rollout(
        ScriptedPolicy(policy, script),
        tokenizer,
        [CALC_ROW],
        1,
        max_new_tokens=64,
        max_total_len=1024,
        temperature=TEMPERATURE,
        chat_template_kwargs=chat_template_kwargs,
    )
    (observation,) = observations(tokenizer, result, 0)
    assert observation.endswith("</tool_response><|im_end|>\n" + next_header) and '{"result": "216"}' in observation
    assert result.metrics["prefix_mismatches"] == mismatches and result.turn_texts[0][0] == first_turn
    width = result.completion_ids.size(1)
    fresh = compute_per_token_logps(
        policy, result.output_ids, width, result.attention_mask, TEMPERATURE
    ).per_token_logps
    mask = result.completion_mask.bool()
    assert (fresh[mask] - result.old_per_token_logps[mask]).abs().max() < 1e-5


@pytest.mark.parametrize(
    "conversation, settings, message",
    [
        (CALC_ROW + [{"role": "assistant", "content": ANSWER}], {}, "ends with an assistant turn"),
        ([{"role": "system", "content": "s", "tools": "[{not json"}, CALC_ROW[1]], {}, "not JSON"),
        ([{"role": "system", "content": "s", "tools": '{"name": "x"}'}, CALC_ROW[1]], {}, "list of function schemas"),
        (
            [
                {
                    "role": "system",
                    "content": "s",
                    "tools": json.dumps([{"type": "function", "function": {"name": "web"}}]),
                },
                CALC_ROW[1],
            ],
            {},
            r"unknown tools \['web'\]",
        ),
        (CALC_ROW, {"max_total_len": 8}, "max_total_len > max_new_tokens"),
        (CALC_ROW, {"max_turns": 0}, "max_turns >= 1"),
        (None, {}, "need conversations"),
    ],
)
def test_bad_input_is_named(policy, tokenizer, conversation, settings, message):
    options = {"max_new_tokens": 8, "max_total_len": 256, **settings}
    with pytest.raises(ValueError, match=message):
        agent_rollout(policy, tokenizer, [conversation] if conversation else [], 1, **options)


def test_a_chat_template_without_tools_is_refused(policy):
    plain = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    plain.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="does not render the tools of conversation 0"):
        agent_rollout(policy, plain, [CALC_ROW], 1, max_new_tokens=8, max_total_len=256)
