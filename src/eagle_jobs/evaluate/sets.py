"""The prompt sets evaluate measures τ on: the held-out validation split, evaluate.prompt_sets, the
long-output set (or only --prompts), each prompt the conversation up to its first user turn; and the
prompts over limits.max_prompt_tokens, counted and left out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NotRequired, TypedDict

from eagle_jobs.errors import BadInput
from eagle_jobs.prompts import load_prompt_index, load_prompts
from eagle_jobs.recipe import LONG_OUTPUT_SET, PromptSpec, Recipe
from eagle_jobs.records import EngineRecord, PositionBucket, TimedPass


class SetTau(TypedDict):
    """One prompt set's τ with one draft, as either backend measures it (decode.evaluate_transformers: its
    own loop; served.tau_pass: a server's /metrics counters and verify steps)."""

    acceptance_length: float
    per_position_acceptance: list[float]
    rounds: int  # verify steps: one verifier forward each
    tokens_generated: int
    outputs: list[list[int]]  # the generated ids of the transformers loop; [] served
    by_position: list[PositionBucket] | None  # None: the server gave no per-request steps


class SetMeasurement(SetTau):
    """What a backend returns for one set and one draft: its τ, the engine that measured it and, served, the
    prompts the server kept and the timed pass (evaluate.run reads it into the report's PromptSetResult)."""

    engine: EngineRecord
    prompts: NotRequired[list[list[dict]]]
    skipped_too_long: NotRequired[int]
    speed: NotRequired[dict[int, TimedPass] | None]  # per concurrency level; None: not timed
    speed_wall_s: NotRequired[float]


def _first_turns(convs) -> list[list[dict]]:
    out = []
    for c in convs:
        if c.request:  # recorded traffic: the request as it was sent, its context included
            out.append([dict(m) for m in c.messages])
            continue
        # a conversation up to its first user turn: what the verifier answers first
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        out.append([dict(m) for m in c.messages[: first_user + 1] if m["role"] != "assistant"])
    return out


def _answer_chars(conv) -> int:
    """The length of a conversation's first recorded answer (0 where it has none)."""
    first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), len(conv.messages))
    return next((len(str(m.get("content") or "")) for m in conv.messages[first_user:] if m["role"] == "assistant"), 0)


def longest_answers(index, n: int, chunk: int = 512) -> list:
    """The n held-out conversations with the longest recorded first answers, read a chunk at a time (a
    held-out split of a million conversations is never in memory at once)."""
    val = [r for r in index.refs if r.split == "validation"]
    best: list = []
    for i in range(0, len(val), chunk):
        best = sorted([*best, *index.load(val[i:i + chunk])], key=_answer_chars, reverse=True)[:n]
    return best


def long_output_set(recipe: Recipe, index) -> list[list[dict]]:
    spec = recipe.evaluate.long_output
    assert spec is not None
    if spec.source is None:
        convs = longest_answers(index, spec.num_prompts)
        if not convs:
            raise BadInput("evaluate.long_output: no source and no held-out split to take long answers from: "
                           "set evaluate.long_output.source or prompts.validation")
    else:
        convs = load_prompts(PromptSpec(source=spec.source, validation=0,
                                        max_rejected_fraction=recipe.prompts.max_rejected_fraction))
    return _first_turns(convs)[:spec.num_prompts]


def max_tokens_of(recipe: Recipe, name: str) -> int:
    """A set's max_new_tokens: evaluate.long_output's for the long-output set, evaluate's for the rest."""
    lo = recipe.evaluate.long_output
    return lo.max_new_tokens if name == LONG_OUTPUT_SET and lo is not None else recipe.evaluate.max_new_tokens


def eval_sets(recipe: Recipe, prompts: Path | None = None) -> dict[str, list[list[dict]]]:
    """The named prompt sets τ is measured on, each on its own: the recipe's held-out validation split,
    every evaluate.prompt_sets source (public benchmarks, held-out files) and the long-output set; or
    only --prompts. All are read and checked here, before any model loads."""
    n = recipe.evaluate.num_prompts
    if prompts is not None:
        sets = {"prompts": _first_turns(load_prompts(PromptSpec(source=str(prompts), validation=0)))}
    else:
        sets = {}
        index = load_prompt_index(recipe.prompts, quiet=True)  # the held-out split's messages only
        val = index.load([c for c in index.refs if c.split == "validation"][:n or None])
        if val:
            sets["validation"] = _first_turns(val)
        for name, source in recipe.evaluate.prompt_sets.items():
            spec = PromptSpec(source=source, validation=0, max_rejected_fraction=recipe.prompts.max_rejected_fraction)
            sets[name] = _first_turns(load_prompts(spec))
        if not sets:
            raise BadInput("evaluate: no prompts to measure on: the recipe's prompt set has no validation split "
                           "and evaluate.prompt_sets is empty; set prompts.validation, add a set, or pass --prompts")
        sets = {name: msgs[:n] if n else msgs for name, msgs in sets.items()}
        if recipe.evaluate.long_output is not None:
            sets[LONG_OUTPUT_SET] = long_output_set(recipe, index)
        return sets
    return {name: msgs[:n] if n else msgs for name, msgs in sets.items()}


def prompt_ids(tok, msgs: list[dict], template_kwargs: dict) -> list[int]:
    """The chat-templated prompt's token ids (transformers returns a BatchEncoding or a list)."""
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **template_kwargs)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def within_limits(recipe: Recipe, sets: dict[str, list[list[dict]]],
                  count: Callable[[list[dict]], int] | None = None) -> tuple[dict, dict[str, int]]:
    """Prompts whose chat-templated length is over limits.max_prompt_tokens are skipped and counted,
    never sent: a real conversation over the server's max-model-len is an HTTP 400 that would end the
    stage (found on ShareGPT's held-out split). Every backend and server keeps the same prompts.
    count: a prompt's length; the transformers backend counts with the verifier's tokenizer, the vLLM
    backend with the server's /tokenize (served_token_count), where the repository's code may run."""
    if count is None:
        from eagle_jobs.verifier import load_tokenizer

        tok, kw = load_tokenizer(recipe.verifier), recipe.chat.template_kwargs()

        def count(msgs: list[dict]) -> int:
            return len(prompt_ids(tok, msgs, kw))

    kept, skipped = {}, {}
    for name, prompts in sets.items():
        ok = [msgs for msgs in prompts if count(msgs) <= recipe.limits.max_prompt_tokens]
        kept[name], skipped[name] = ok, len(prompts) - len(ok)
        if not ok:
            raise BadInput(f"evaluate: every prompt of set '{name}' is longer than limits.max_prompt_tokens "
                           f"({recipe.limits.max_prompt_tokens}): raise it, or use shorter prompts")
    return kept, skipped


def served_token_count(recipe: Recipe, base: str, model: str) -> Callable[[list[dict]], int]:
    """A prompt's chat-templated length as the server counts it: POST /tokenize renders the chat
    template the chat endpoint renders (vllm 0.32 entrypoints/serve/tokenize/protocol.py,
    TokenizeChatRequest: add_generation_prompt defaults to true; the answer's `count`)."""
    import httpx

    kw = recipe.chat.template_kwargs()

    def count(msgs: list[dict]) -> int:
        r = httpx.post(f"{base}/tokenize", json={"model": model, "messages": msgs,
                                                 **({"chat_template_kwargs": kw} if kw else {})}, timeout=60)
        r.raise_for_status()
        return int(r.json()["count"])

    return count


def eval_prompts(recipe: Recipe, prompts: Path | None) -> list[list[dict]]:
    """The first set of eval_sets: --prompts, else the validation split, else the first named set."""
    return next(iter(eval_sets(recipe, prompts).values()))


def set_source(recipe: Recipe, name: str, prompts: Path | None) -> str:
    if prompts is not None:
        return str(prompts)
    if name == "validation":
        return recipe.prompts.source
    if name == LONG_OUTPUT_SET and recipe.evaluate.long_output is not None:
        return recipe.evaluate.long_output.source or (f"the {recipe.evaluate.long_output.num_prompts} held-out "
                                                      f"conversations of {recipe.prompts.source} with the longest "
                                                      "recorded first answers")
    return recipe.evaluate.prompt_sets[name]
