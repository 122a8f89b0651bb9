"""Batched multi-turn rollouts for agent RL: the model's turns and the tools' replies as one token sequence.

``agent_rollout`` advances all B x G conversations together, one turn per batched ``generate`` call (left-padded),
or per ``/generate`` request to an SGLang server (``server``: ``--rollout_engine sglang``).
Each turn the model writes; ``tools.parse_tool_calls`` reads its calls; a conversation without a call, or at
``max_turns``, leaves the batch; the others get one ``tool`` message per call (``tools.execute_call``) and the
chat template (tools from the conversation's system turn) renders what follows the model's turn: the observation,
tokens that are seen, never trained (``completion_mask`` 0, old log-prob 0). Source: upstream MiniMind's
``trainer/train_agent.py`` (``rollout_single``), which rolls out one conversation at a time.

Observation tokens: the rendered text after the model's closing ``<|im_end|>`` (from the template's own
``<|im_end|>`` on where the turn stopped without one), tokenised alone. It begins at or right after a special
token, so no BPE merge crosses the boundary; each turn is generated from exactly the tokens returned, so the
recorded old log-probs equal a forward over the whole conversation. Upstream instead re-tokenises the whole
conversation and keeps the tokens past the conversation's length; every turn checks that this re-tokenisation
equals the conversation's tokens plus the observation. Where it does not (the model sampled a split BPE would
merge, or the template rewrote its text, e.g. stripped leading newlines), the model's own tokens are kept and
``metrics["prefix_mismatches"]`` counts it.

Long conversations: upstream cuts prompt + completion from the left to ``max_total_len`` after the rollout, which
drops the prompt from the context of the trained tokens (their log-probs then differ from the recorded ones).
Here nothing after the prompt is ever cut: a prompt is cut from the left to its last ``max_total_len -
max_new_tokens`` tokens (``metrics["prompts_cut"]``); a turn stops at the room left under ``max_total_len``; a
conversation whose observation leaves no room for one more token ends there, unfinished (``metrics["length_stops"]``).
"""

import copy
import json
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainer.agent.tools import conversation_tools, count_valid_calls, execute_call, parse_tool_calls
from trainer.infra.distributed import unwrap_model
from trainer.infra.errors import InputError
from trainer.infra.sglang_client import check_sglang_prompts, sglang_sampling_params


@dataclass
class AgentRolloutResult:
    """What ``agent_rollout`` returns: N = B * num_generations conversations, P prompt and R completion tokens."""

    output_ids: torch.Tensor  # long [N, P + R], prompts (left-padded) then completions (right-padded)
    completion_ids: torch.Tensor  # long [N, R], model turns and observations in order
    old_per_token_logps: torch.Tensor  # fp32 [N, R], log pi_old of the model's tokens, 0 elsewhere
    completion_mask: torch.Tensor  # long [N, R], 1 on the model's own tokens only (the loss mask)
    attention_mask: torch.Tensor  # long [N, P + R], 1 on every real token (prompt, model turns, observations)
    final_answers: list  # N texts: each conversation's last model turn, without its EOS
    turn_texts: list  # N lists: every model turn's text, in order
    num_tool_calls: torch.Tensor  # long [N], <tool_call> blocks over all turns (malformed ones included)
    num_valid_calls: torch.Tensor  # long [N], calls to an offered tool whose arguments pass check_arguments
    num_turns: torch.Tensor  # long [N], model turns
    unfinished: torch.Tensor  # bool [N], the last turn called a tool (max_turns or max_total_len reached)
    metrics: dict = field(default_factory=dict)  # prefix_mismatches, prompts_cut, length_stops (ints)
    sampling_per_token_logps: Optional[torch.Tensor] = None  # fp32 [N, R], the server's on the model's tokens (SGLang)

    @property
    def prompt_mask(self):
        """long [N, P]: the prompts' attention mask."""
        return self.attention_mask[:, : self.output_ids.size(1) - self.completion_ids.size(1)]


class Conversation:
    """One conversation's state during a rollout: its messages, its tokens (prompt, then the completion with its
    mask and old log-probs) and its tool-call counts."""

    def __init__(self, messages, tools, prompt_ids, prompt_cut, template_kwargs):
        self.messages = copy.deepcopy(messages)
        self.tools = tools
        self.template_kwargs = template_kwargs  # the chat template's extra arguments (open_thinking)
        self.prompt_ids = list(prompt_ids)
        self.prompt_cut = prompt_cut  # tokens cut from the prompt's left
        self.completion_ids, self.completion_mask, self.old_per_token_logps = [], [], []
        self.turn_texts = []
        self.num_tool_calls = self.num_valid_calls = 0
        self.unfinished = False

    @property
    def token_ids(self):
        """Prompt then completion: the context of the next turn."""
        return self.prompt_ids + self.completion_ids

    @property
    def allowed(self):
        return [tool["function"]["name"] for tool in self.tools or []]

    def extend(self, ids, logps, trained):
        self.completion_ids += ids
        self.completion_mask += [int(trained)] * len(ids)
        self.old_per_token_logps += logps if trained else [0.0] * len(ids)


def render(tokenizer, messages, tools, add_generation_prompt, chat_template_kwargs):
    """The chat template's text of ``messages`` with ``tools`` (None: no tools block)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **chat_template_kwargs
    )


def observation_ids(tokenizer, conversation, ended_with_eos):
    """(observation token ids, whether re-tokenising the whole conversation gives its tokens + them).

    The observation: the template's text after the model's last turn (its messages end with that ``assistant``
    message and its ``tool`` messages), up to and including the next generation prompt (module docstring).
    Raises ValueError for a template that renders earlier turns differently once later ones follow, or that does
    not close an assistant turn with the tokenizer's EOS token.
    """
    messages, eos = conversation.messages, tokenizer.eos_token
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    kwargs = conversation.template_kwargs
    partial = render(tokenizer, messages[: last_assistant + 1], conversation.tools, False, kwargs)
    full = render(tokenizer, messages, conversation.tools, True, kwargs)
    close = partial.rfind(eos)
    if not full.startswith(partial) or close < 0:
        raise InputError(
            f"agent_rollout needs a chat template that only appends to earlier turns and closes an "
            f"assistant turn with {eos!r}; this one renders {partial[-60:]!r} then {full[-60:]!r}"
        )
    start = close + len(eos) if ended_with_eos else close
    ids = tokenizer(full[start:], add_special_tokens=False)["input_ids"]
    retokenized = tokenizer(full, add_special_tokens=False)["input_ids"][conversation.prompt_cut :]
    return ids, retokenized == conversation.token_ids + ids


def cut_turn(ids, logps, budget, eos_token_id):
    """One generated turn of a multi-turn rollout: (ids, logps), two lists, kept up to and including the first EOS
    and to at most ``budget`` tokens (a prefix of a sample is a sample of that prefix)."""
    ids, logps = list(ids[:budget]), list(logps[:budget])
    end = ids.index(eos_token_id) + 1 if eos_token_id in ids else len(ids)
    return ids[:end], logps[:end]


@torch.no_grad()
def generate_turn(model, contexts, budgets, temperature, eos_token_id, pad_token_id, generator):
    """One batched ``generate`` over left-padded contexts -> a (token ids, old log-probs) pair per row.

    contexts: A lists of token ids; budgets: A ints >= 1, each row's most new tokens. Sampling at ``temperature``
    without top-p / top-k, log-probs log_softmax(logits / temperature) recorded while sampling (``generate``).
    Each row keeps its tokens up to and including its first EOS, at most its budget.
    """
    device = next(model.parameters()).device
    width = max(len(ids) for ids in contexts)
    input_ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)  # [A, L]
    attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)  # [A, L]
    for row, ids in enumerate(contexts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    output_ids, per_token_logps = model.generate(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max(budgets),
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        generator=generator,
    )  # [A, L + T], [A, T]
    return [
        cut_turn(output_ids[row, width:].tolist(), per_token_logps[row].tolist(), budget, eos_token_id)
        for row, budget in enumerate(budgets)
    ]


@torch.no_grad()
def server_turn(engine, contexts, budgets, temperature=1.0):
    """One turn of the multi-turn rollouts in one ``/generate`` request to ``engine``'s server
    (an ``SGLangRolloutEngine``, chapter 8.2).

    contexts: A lists of token ids, each conversation so far (prompt, earlier turns, tool replies);
    budgets: A ints >= 1, each row's most new tokens, sent as its own ``max_new_tokens`` (the server refuses a
    request whose prompt + max_new_tokens passes its context length); sampled at ``temperature`` with the
    engine's top-p / top-k, kept up to and including the first EOS (``cut_turn``). Returns A (token ids, the
    server's log-probs) pairs of lists; the caller settles the old log-probs with ``engine.old_per_token_logps`` once
    the conversations are whole. Raises ValueError for contexts the server cannot take
    (``check_sglang_prompts``) and RuntimeError for answers that fail ``SGLangClient``'s checks.
    """
    vocab_size = unwrap_model(engine.policy_model).config.vocab_size
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(ids, dtype=torch.long) for ids in contexts], batch_first=True
    )  # [A, L], right-padded with 0
    lengths = torch.tensor([len(ids) for ids in contexts])  # [A]
    check_sglang_prompts(padded, (torch.arange(padded.size(1)) < lengths.unsqueeze(1)).long(), vocab_size)
    sampling_params = [
        sglang_sampling_params(
            temperature, engine.sampling["top_p"], engine.sampling["top_k"], budget, engine.tokenizer.eos_token_id
        )
        for budget in budgets
    ]  # per row
    answers = engine.client.generate([list(ids) for ids in contexts], sampling_params)
    return [
        cut_turn(ids, logps, budget, engine.tokenizer.eos_token_id) for (ids, logps), budget in zip(answers, budgets)
    ]


@torch.no_grad()
def agent_rollout(
    model,
    tokenizer,
    conversations,
    num_generations,
    *,
    max_new_tokens,
    max_total_len,
    temperature=1.0,
    max_turns=3,
    generator=None,
    chat_template_kwargs=None,
    server=None,
):
    """Roll out ``num_generations`` multi-turn tool-using answers to each conversation, all rows batched per turn.

    model: a MiniMind causal LM (or DDP wrapper) with ``generate``; tokenizer: a chat template taking ``tools``.
    conversations: B prompt conversations (role/content dicts in upstream's format, tools on the system turn, last
    turn not the assistant's). max_new_tokens: per turn; max_total_len: prompt + completion, > max_new_tokens.
    chat_template_kwargs: extra template arguments (e.g. ``open_thinking``), one dict for every conversation or a
    list of B dicts, one per prompt (upstream's ``--thinking_ratio`` draws ``open_thinking`` per prompt).
    server: None, the turns sampled with ``model.generate`` and their log-probs recorded while sampling; or an
    ``SGLangRolloutEngine`` (chapter 8.2) whose server generates each turn (``server_turn``), the old log-probs
    then settled on the whole conversations by ``server.old_per_token_logps`` (``--sglang_logprobs``: a forward of
    ``model``, or the server's once checked; ``metrics["logprob_gap"]``). Returns ``AgentRolloutResult`` with
    N = B * num_generations rows ordered P0, P0, ..., P1, ... on the model's device. Raises ValueError for bad
    conversations or tools (``start_conversations``), no conversations, a count < 1, ``max_total_len`` <=
    ``max_new_tokens``, a list of kwargs of another length than B; RuntimeError for the server's (``SGLangClient``).
    """
    if (
        not conversations
        or num_generations < 1
        or max_turns < 1
        or max_new_tokens < 1
        or max_total_len <= max_new_tokens
    ):
        raise ValueError(
            f"need conversations, num_generations >= 1, max_turns >= 1, max_new_tokens >= 1 and "
            f"max_total_len > max_new_tokens, got {len(conversations)} conversations, "
            f"{num_generations}, {max_turns}, {max_new_tokens}, {max_total_len}"
        )
    if not isinstance(chat_template_kwargs, list):
        chat_template_kwargs = [chat_template_kwargs or {}] * len(conversations)
    if len(chat_template_kwargs) != len(conversations):
        raise ValueError(
            f"chat_template_kwargs: {len(chat_template_kwargs)} dicts for {len(conversations)} conversations"
        )
    metrics = {"prefix_mismatches": 0, "prompts_cut": 0, "length_stops": 0}
    rows = start_conversations(
        tokenizer, conversations, num_generations, max_total_len - max_new_tokens, chat_template_kwargs, metrics
    )
    generating_model = unwrap_model(model)
    was_training = generating_model.training
    generating_model.eval()
    try:
        active = list(range(len(rows)))
        for turn in range(max_turns):
            if not active:
                break
            budgets = [min(max_new_tokens, max_total_len - len(rows[i].token_ids)) for i in active]
            contexts = [rows[i].token_ids for i in active]
            generated = (
                server_turn(server, contexts, budgets, temperature)
                if server is not None
                else generate_turn(
                    generating_model,
                    contexts,
                    budgets,
                    temperature,
                    tokenizer.eos_token_id,
                    tokenizer.pad_token_id,
                    generator,
                )
            )
            still_active = []
            for i, budget, (ids, logps) in zip(active, budgets, generated):
                cut_at_room = budget < max_new_tokens and len(ids) == budget and ids[-1] != tokenizer.eos_token_id
                if take_turn(
                    tokenizer, rows[i], ids, logps, cut_at_room, turn == max_turns - 1, max_total_len, metrics
                ):
                    still_active.append(i)
            active = still_active
    finally:
        generating_model.train(was_training)
    result = batch_conversations(rows, tokenizer.pad_token_id, next(generating_model.parameters()).device, metrics)
    if server is not None:  # the server's log-probs -> the trainer's (or the server's, checked) on the model's tokens
        old_per_token_logps, gap_metrics = server.old_per_token_logps(
            generating_model,
            result.output_ids,
            result.attention_mask,
            result.completion_mask,
            result.old_per_token_logps,
            temperature,
        )  # [N, R]
        result.sampling_per_token_logps = result.old_per_token_logps * result.completion_mask  # the server's
        result.old_per_token_logps = old_per_token_logps * result.completion_mask
        result.metrics.update(gap_metrics)
    return result


def start_conversations(tokenizer, conversations, num_generations, max_prompt_len, chat_template_kwargs, metrics):
    """num_generations ``Conversation`` copies of each prompt, rendered with its tools and its template arguments
    (``chat_template_kwargs``: one dict per conversation) and cut from the left to ``max_prompt_len`` tokens (the
    generation prompt stays). Raises ValueError naming a conversation that ends with the assistant, has bad tools,
    or whose tools the chat template does not render."""
    rows = []
    for index, (messages, kwargs) in enumerate(zip(conversations, chat_template_kwargs)):
        if not messages or messages[-1].get("role") == "assistant":
            raise ValueError(
                f"conversation {index} is empty or ends with an assistant turn: pass the prompt turns "
                f"(upstream's AgentRLDataset drops a row's last turn)"
            )
        messages, tools = conversation_tools(messages)
        prompt = render(tokenizer, messages, tools, True, kwargs)
        if tools and not all(json.dumps(tool["function"]["name"]) in prompt for tool in tools):
            raise ValueError(
                f"the tokenizer's chat template does not render the tools of conversation {index}: "
                f"use a template that takes tools= (upstream MiniMind's tokenizer has one)"
            )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        cut = max(len(prompt_ids) - max_prompt_len, 0)
        metrics["prompts_cut"] += int(cut > 0) * num_generations
        rows += [Conversation(messages, tools, prompt_ids[cut:], cut, kwargs) for _ in range(num_generations)]
    return rows


def take_turn(tokenizer, row, ids, logps, cut_at_room, last_turn, max_total_len, metrics):
    """Record one model turn (mask 1) in ``row``; True when the conversation goes on, its observation (mask 0)
    appended: the turn called a tool, it is not the last turn, was not cut at ``max_total_len`` and the
    observation leaves room for a token of the next turn. ``metrics`` counts length stops and prefix mismatches."""
    ended_with_eos = bool(ids) and ids[-1] == tokenizer.eos_token_id
    row.extend(ids, logps, trained=True)
    text = tokenizer.decode(ids[:-1] if ended_with_eos else ids, skip_special_tokens=False)
    row.turn_texts.append(text)
    calls = parse_tool_calls(text)
    row.num_tool_calls += len(calls)
    row.num_valid_calls += count_valid_calls(calls, row.allowed)
    row.unfinished = bool(calls)
    metrics["length_stops"] += int(cut_at_room)
    if not calls or cut_at_room or last_turn:
        return False
    row.messages.append({"role": "assistant", "content": text})
    row.messages += [{"role": "tool", "content": execute_call(call, allowed=row.allowed)} for call in calls]
    obs_ids, prefix_kept = observation_ids(tokenizer, row, ended_with_eos)
    metrics["prefix_mismatches"] += int(not prefix_kept)
    if len(row.token_ids) + len(obs_ids) + 1 > max_total_len:
        metrics["length_stops"] += 1
        return False
    row.extend(obs_ids, [], trained=False)
    row.unfinished = False
    return True


def batch_conversations(rows, pad_token_id, device, metrics):
    """Pad the conversations into an ``AgentRolloutResult`` on ``device``: prompts left, completions right."""
    prompt_width = max(len(row.prompt_ids) for row in rows)  # P
    width = max(len(row.completion_ids) for row in rows)  # R
    output_ids = torch.full((len(rows), prompt_width + width), pad_token_id, dtype=torch.long)  # [N, P + R]
    attention_mask = torch.zeros((len(rows), prompt_width + width), dtype=torch.long)  # [N, P + R]
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [N, R]
    old_per_token_logps = torch.zeros((len(rows), width), dtype=torch.float32)  # [N, R]
    for n, row in enumerate(rows):
        start, length = prompt_width - len(row.prompt_ids), len(row.completion_ids)
        output_ids[n, start : prompt_width + length] = torch.tensor(row.token_ids, dtype=torch.long)
        attention_mask[n, start : prompt_width + length] = 1
        completion_mask[n, :length] = torch.tensor(row.completion_mask, dtype=torch.long)
        old_per_token_logps[n, :length] = torch.tensor(row.old_per_token_logps, dtype=torch.float32)
    counts = torch.tensor(
        [[row.num_tool_calls, row.num_valid_calls, len(row.turn_texts)] for row in rows], dtype=torch.long
    )  # [N, 3]
    return AgentRolloutResult(
        output_ids=output_ids.to(device),
        completion_ids=output_ids[:, prompt_width:].to(device),
        old_per_token_logps=old_per_token_logps.to(device),
        completion_mask=completion_mask.to(device),
        attention_mask=attention_mask.to(device),
        final_answers=[row.turn_texts[-1] for row in rows],
        turn_texts=[list(row.turn_texts) for row in rows],
        num_tool_calls=counts[:, 0].to(device),
        num_valid_calls=counts[:, 1].to(device),
        num_turns=counts[:, 2].to(device),
        unfinished=torch.tensor([row.unfinished for row in rows], dtype=torch.bool, device=device),
        metrics=metrics,
    )


def template_kwargs(open_thinking):
    """The chat template's arguments of each prompt of a batch: ``open_thinking`` (bools, the dataset's draw by
    ``--thinking_ratio``; a prompt that opens thinking ends in ``<think>\\n``)."""
    return [{"open_thinking": bool(value)} for value in open_thinking]


def ended_with_eos(rollout, eos_token_id):
    """bool [N]: each conversation's last model token is EOS (its last turn was not cut at --max_gen_len)."""
    mask = rollout.completion_mask  # [N, R]
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()  # [N, R], the last model token
    return ((rollout.completion_ids == eos_token_id) & last).any(dim=1)  # [N]
