"""A captured turn becomes a training row: the exact token ids, the loss mask on generated tokens, and the
parsed reasoning and content (docs/FORMAT.md#capture)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_jobs.prompts import Conversation
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import Row


@dataclass
class Turn:
    """One generation request: a conversation's history up to a user turn."""

    conv: Conversation
    turn: int
    messages: list[dict]


@dataclass
class Generation:
    prompt_ids: list[int]
    completion_ids: list[int]
    reasoning: str | None
    content: str
    finish_reason: str


@dataclass
class ShardStats:
    rows: int = 0
    tokens: int = 0
    completion_tokens: int = 0
    skipped_too_long: int = 0
    skipped: list[str] = field(default_factory=list)
    reused: int = 0


def parse_reasoning(text: str, parser: str | None, thinking: bool = True) -> tuple[str | None, str]:
    """Split <think>...</think> the way vLLM's kimi_k2 / deepseek_r1 parsers do.

    With thinking on, the chat template has already opened <think>, so text with
    no </think> is all reasoning (the answer was cut off mid-thought).
    """
    if parser is None:
        return None, text.strip()
    start, end = "<think>", "</think>"
    if end in text:
        before, _, after = text.partition(end)
        return before.split(start, 1)[-1].strip(), after.strip()
    if text.lstrip().startswith(start) or thinking:
        return text.split(start, 1)[-1].strip(), ""
    return None, text.strip()


def make_row(recipe: Recipe, t: Turn, g: Generation) -> Row:
    ids = (g.prompt_ids + g.completion_ids)[: recipe.limits.max_seq_len]
    mask = ([0] * len(g.prompt_ids) + [1] * len(g.completion_ids))[: len(ids)]
    return Row(
        row_id=f"{t.conv.index:08d}-{t.turn:02d}",
        prompt_index=t.conv.index,
        prompt_sha256=t.conv.sha,
        turn=t.turn,
        split=t.conv.split,
        input_ids=ids,
        loss_mask=mask,
        num_prompt_tokens=len(g.prompt_ids),
        num_completion_tokens=sum(mask),
        finish_reason=g.finish_reason,
        reasoning=g.reasoning,
        content=g.content,
    )


def start_history(recipe: Recipe, conv: Conversation) -> tuple[list[dict], list[dict]]:
    msgs = [m for m in conv.messages if m["role"] != "assistant"]
    history: list[dict] = []
    if recipe.chat.system_prompt and not any(m["role"] == "system" for m in msgs):
        history.append({"role": "system", "content": recipe.chat.system_prompt})
    return history, msgs
