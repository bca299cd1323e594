"""capture's two ways to regenerate answers: transformers' generate in this process, or a vLLM server in its
served reasoning mode, many requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable, Mapping
from typing import Protocol, cast

import torch

from eagle_jobs.capture.rows import (
    Generation,
    ShardStats,
    Turn,
    make_row,
    parse_reasoning,
    start_history,
)
from eagle_jobs.prompts import Conversation
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import Advance, Row
from eagle_jobs.sampling import ServedSampling, effective, request_fields
from eagle_jobs.sharding import chunked

ShardWork = list[tuple[int, list[Conversation], "ShardStats"]]  # (shard number, conversations, stats)


class GenerationBackend(Protocol):
    """A capture backend: the verifier regenerates each conversation's answers (transformers' generate in
    this process, or a vLLM server in its served mode); `done(key, rows)` as each shard ends."""

    def run(self, convs: list[Conversation], stats: ShardStats, advance: Advance) -> list[Row]: ...

    def run_shards(self, work: ShardWork, advance: Advance, done: Callable[[int, list[Row]], None]) -> None: ...


class TransformersBackend:
    """In-process batched generation: CPU runs and tests."""

    def __init__(self, recipe: Recipe):
        from eagle_jobs.verifier import load_verifier

        self.recipe = recipe
        self.v = load_verifier(recipe.verifier)
        self.tok = self.v.tokenizer
        self.kw = recipe.chat.template_kwargs()
        self.sampling = effective(recipe)
        self.generator = torch.Generator()
        eos = self.v.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tok.eos_token_id])

    def _template(self, messages: list[dict]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **self.kw)
        # tokenize=True gives one conversation's ids, or a BatchEncoding (a mapping) holding them
        return list(cast("list[int]", out["input_ids"] if isinstance(out, Mapping) else out))

    def _generate(self, batch: list[list[int]], max_new: int) -> list[tuple[list[int], str]]:
        pad = self.tok.pad_token_id
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        att = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            att[i, width - len(p):] = 1
        from transformers import LogitsProcessorList

        sampler = ServedSampling(self.sampling, [len(p) for p in batch], width, self.generator)
        # Greedy generate with vLLM's sampler as the one logits processor: transformers' own warpers never
        # run, and nothing comes from the model's generation_config (transformers 5.19's
        # _prepare_generation_config fills fields from it, then from its global defaults such as top_k 50,
        # and only then applies these arguments: an explicit None switches a processor off).
        off = dict.fromkeys(("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                             "no_repeat_ngram_size"))
        with torch.inference_mode():
            # a false positive: transformers annotates generate's self as a Protocol written for the `ty` checker,
            # which no model loaded by AutoModelForCausalLM meets under mypy
            out = self.v.model.generate(  # type: ignore[misc]
                input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False, **off,
                logits_processor=LogitsProcessorList([sampler]),
                pad_token_id=pad, eos_token_id=sorted(self.eos),
            )
        res = []
        for row in out[:, width:].tolist():
            comp, reason = [], "length"
            for t in row:
                comp.append(t)
                if t in self.eos:
                    reason = "stop"
                    break
            res.append((comp, reason))
        return res

    def run(self, convs: list[Conversation], stats: ShardStats, advance: Advance) -> list[Row]:
        r, lim = self.recipe, self.recipe.limits
        self.generator.manual_seed(r.sampling.seed + (convs[0].index if convs else 0))
        state = {c.index: start_history(r, c) for c in convs}
        pos = {c.index: 0 for c in convs}
        turn_no = {c.index: 0 for c in convs}
        rows: list[Row] = []
        while True:
            pending: list[tuple[Turn, list[int]]] = []
            for c in convs:
                history, msgs = state[c.index]
                # advance to the next user turn, carrying system/tool turns along
                while pos[c.index] < len(msgs) and msgs[pos[c.index]]["role"] != "user":
                    history.append(msgs[pos[c.index]])
                    pos[c.index] += 1
                if pos[c.index] >= len(msgs):
                    continue
                history.append(msgs[pos[c.index]])
                pos[c.index] += 1
                prompt = self._template(history)
                if len(prompt) > lim.max_prompt_tokens:
                    stats.skipped_too_long += 1
                    stats.skipped.append(f"{c.index}:{turn_no[c.index]}")
                    pos[c.index] = len(msgs)  # later turns would be longer still
                    continue
                pending.append((Turn(c, turn_no[c.index], list(history)), prompt))
                turn_no[c.index] += 1
            if not pending:
                return rows
            pending.sort(key=lambda x: len(x[1]))
            for batch in chunked(pending, r.capture.batch_size):
                longest = max(len(p) for _, p in batch)
                max_new = max(1, min(self.sampling["max_tokens"], lim.max_seq_len - longest))
                for (t, prompt), (comp, reason) in zip(batch, self._generate([p for _, p in batch], max_new)):
                    # one sequence's ids decode to one string (decode is annotated str | list[str])
                    text = cast(str, self.tok.decode([x for x in comp if x not in self.eos],
                                                     skip_special_tokens=r.chat.reasoning_parser is None))
                    reasoning, content = parse_reasoning(text, r.chat.reasoning_parser, r.chat.thinking)
                    g = Generation(prompt, comp, reasoning, content, reason)
                    rows.append(make_row(r, t, g))
                    state[t.conv.index][0].append({"role": "assistant", "content": content})
                    advance(0, len(comp))

    def run_shards(self, work: ShardWork, advance: Advance, done: Callable[[int, list[Row]], None]) -> None:
        """One shard after another: `done(key, rows)` as each ends."""
        for key, convs, stats in work:
            done(key, self.run(convs, stats, advance))


class RequestSlots:
    """`n` requests in flight, a free slot going to the earliest shard that waits.

    A plain semaphore wakes waiters in arrival order: a conversation's second turn would queue behind
    the next shard's first turns and hold its own shard's commit back.
    """

    def __init__(self, n: int):
        self.free = n
        self.waiting: list[tuple[int, int, asyncio.Future]] = []  # heap: (shard rank, arrival, future)
        self.arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, rank: int):
        if self.free and not self.waiting:
            self.free -= 1
        else:
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self.waiting, (rank, next(self.arrivals), fut))
            await fut  # the releasing request hands its slot over
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self.waiting:
            fut = heapq.heappop(self.waiting)[2]
            if not fut.done():  # a waiter cancelled with its shard takes no slot
                fut.set_result(None)
                return
        self.free += 1


class VllmBackend:
    """Any vLLM OpenAI-compatible server: /v1/chat/completions with return_token_ids."""

    def __init__(self, recipe: Recipe, base_url: str):
        self.recipe, self.base = recipe, base_url
        self.kw = recipe.chat.template_kwargs()
        self.sampling = effective(recipe)

    async def _model_id(self, client) -> str:
        r = await client.get(f"{self.base}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    async def _conversation(self, client, model: str, c: Conversation, stats: ShardStats, advance,
                            slot) -> list[Row]:
        from eagle_jobs.vllm_server import post_with_retries

        r = self.recipe
        history, msgs = start_history(r, c)
        rows, turn = [], 0
        for m in msgs:
            history.append(m)
            if m["role"] != "user":
                continue
            kw = {"chat_template_kwargs": self.kw} if self.kw else {}
            retries = r.capture.vllm.max_retries
            async with slot():
                # The prompt's length before any generation: vLLM answers a prompt at or over its
                # max-model-len with HTTP 400 (every rerun again), and one over max_prompt_tokens would
                # only be thrown away. /tokenize renders the same chat template as the chat endpoint
                # (vllm/entrypoints/serve/tokenize/protocol.py: count, max_model_len).
                size = await post_with_retries(client, f"{self.base}/tokenize",
                                               {"model": model, "messages": history, **kw}, retries)
                if size["count"] > r.limits.max_prompt_tokens or size["count"] >= size["max_model_len"]:
                    stats.skipped_too_long += 1
                    stats.skipped.append(f"{c.index}:{turn}")
                    break  # later turns would be longer still
                # Documented request fields: vllm/entrypoints/openai/chat_completion/protocol.py; every
                # sampling field explicit, so the server's generation-config flags never decide
                body = {
                    "model": model, "messages": history, **request_fields(self.sampling),
                    "seed": (r.sampling.seed + int(c.sha[:8], 16)) % 2**31, "return_token_ids": True, **kw,
                }
                resp = await post_with_retries(client, f"{self.base}/v1/chat/completions", body, retries)
            choice = resp["choices"][0]
            prompt_ids = list(resp["prompt_token_ids"])
            msg = choice.get("message") or {}
            g = Generation(prompt_ids, list(choice["token_ids"]), msg.get("reasoning"),
                           msg.get("content") or "", choice.get("finish_reason") or "stop")
            rows.append(make_row(r, Turn(c, turn, list(history)), g))
            history.append({"role": "assistant", "content": g.content})
            advance(0, len(g.completion_ids))
            turn += 1
        return rows

    def run(self, convs: list[Conversation], stats: ShardStats, advance: Advance) -> list[Row]:
        out: list[Row] = []
        self.run_shards([(0, convs, stats)], advance, lambda _key, rows: out.extend(rows))
        return out

    def run_shards(self, work: ShardWork, advance: Advance, done: Callable[[int, list[Row]], None]) -> None:
        """Shards overlap: the next shard's requests fill the server while the last one's longest answers
        finish, so `concurrency` requests stay in flight across shard ends. `done(key, rows)` runs as each
        shard ends (in the event loop, one at a time); earlier shards take the request slots first."""
        import httpx

        conc = self.recipe.capture.concurrency

        async def main() -> None:
            timeout = httpx.Timeout(self.recipe.capture.vllm.request_timeout_s, connect=30)
            limits = httpx.Limits(max_connections=conc)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                model = await self._model_id(client)
                slots = RequestSlots(conc)
                # enough shards open to fill every slot while one shard's tail runs, and no more
                # (a worker's whole share could be 100,000s of conversations)
                smallest = min(len(convs) for _k, convs, _s in work)
                window = asyncio.Semaphore(1 + -(-conc // max(1, smallest)))

                async def shard(rank, key, convs, stats) -> None:
                    async with window:
                        results = await asyncio.gather(*(
                            self._conversation(client, model, c, stats, advance, lambda: slots.slot(rank))
                            for c in convs))
                    done(key, [row for rs in results for row in rs])

                await asyncio.gather(*(shard(rank, *w) for rank, w in enumerate(work)))

        asyncio.run(main())
