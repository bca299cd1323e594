"""Stage 4, evaluate: mean acceptance length tau under greedy chain speculative decoding.

tau is tokens per verifier forward, bonus token included: vLLM's 1 + accepted/drafts.
Backends:
- transformers: a real speculative decoding loop on CPU. Verifier prefill; the
  draft proposes k tokens from the verifier's fused aux states (its own hidden
  output feeding its next step, as at EAGLE-3 test time); the verifier checks
  them in one forward; the longest agreeing prefix plus the bonus token is kept.
  Its output equals plain greedy decoding of the verifier (tested).
- vllm: serve verifier + draft with --speculative-config and read the
  vllm:spec_decode_* counters from /metrics.
Also reported: the teacher-forced estimate from training's per-step accuracies,
and the same loop with an untrained draft, so the gain is visible.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import torch

from eagle_jobs.committed import download_final, extraction_info
from eagle_jobs.deploy import advise
from eagle_jobs.errors import BadInput, Unavailable
from eagle_jobs.layout import StageName, content_hash, eval_dir, train_dir
from eagle_jobs.progress import console, stage_progress
from eagle_jobs.prompts import load_prompt_index, load_prompts
from eagle_jobs.recipe import LONG_OUTPUT_SET, PromptSpec, Recipe
from eagle_jobs.records import (
    EngineRecord,
    EvalReport,
    PositionBucket,
    PromptSetResult,
    SpeedLevel,
    SpeedTable,
    TimedPass,
)
from eagle_jobs.serve_plans import evaluate_plan
from eagle_jobs.store import Stage, Store

STAGE = StageName.EVALUATE.dir


@dataclass
class Acceptance:
    k: int
    rounds: int = 0
    accepted: int = 0
    tokens: int = 0
    per_pos: list[int] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)  # (output position the step starts at, accepted)

    def add(self, a: int, position: int) -> None:
        if not self.per_pos:
            self.per_pos = [0] * self.k
        self.rounds += 1
        self.accepted += a
        self.steps.append((position, a))
        for i in range(a):
            self.per_pos[i] += 1

    @property
    def tau(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 1.0

    def per_position(self) -> list[float]:
        return [c / self.rounds if self.rounds else 0.0 for c in (self.per_pos or [0] * self.k)]


def steps_of_request(per_step_accepted: list[int]) -> list[tuple[int, int]]:
    """A served request's verify steps as (output position, accepted): the first output token comes from
    prefill, and a step that accepts a drafts adds a + 1 tokens (as speculative_generate counts them)."""
    out, position = [], 1
    for a in per_step_accepted:
        out.append((position, a))
        position += a + 1
    return out


def by_position(steps: list[tuple[int, int]], bucket: int) -> list[PositionBucket]:
    """τ of the verify steps that start in each bucket of output positions, up to the last bucket reached."""
    if not steps:
        return []
    sums: dict[int, list[int]] = {}
    for position, a in steps:
        s = sums.setdefault(position // bucket, [0, 0])
        s[0] += 1
        s[1] += a
    return [{"start": b * bucket, "end": (b + 1) * bucket, "verify_steps": sums[b][0],
             "acceptance_length": 1 + sums[b][1] / sums[b][0]} for b in sorted(sums)]


# -- the draft at test time ---------------------------------------------------------------
def load_draft(path: Path, verifier_path: str, untrained: bool = False, seed: int = 0):
    """The trained draft from its checkpoint, or the same architecture untrained (baseline)."""
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    # an Eagle3SpeculatorConfig (the class's config_class), though from_pretrained is annotated with the base class
    config = cast(Eagle3SpeculatorConfig, Eagle3DraftModel.config_class.from_pretrained(str(path)))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 - never serialized
    config.speculators_config.verifier.name_or_path = verifier_path
    if not untrained:
        model = Eagle3DraftModel.from_pretrained(str(path), config=config)
    else:
        torch.manual_seed(seed)
        model = Eagle3DraftModel(config)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            model.load_vocab_mappings(f.get_tensor("t2d") if "t2d" in keys else None,
                                      f.get_tensor("d2t") if "d2t" in keys else None)
        model.load_verifier_weights()
        # load_verifier_weights leaves the draft lm_head as the t2d-sliced verifier head
    return model.float().eval()


class DraftProposer:
    """Chain drafting with speculators' Eagle3DraftModel modules, mirroring its TTT forward.

    Step 0 sees the pairs (x_{j+1}, g_j) of every position so far; their keys are
    kept across rounds (causal: later tokens never change them), so a round only
    runs the positions accepted since the last one, then k-1 single-query steps
    whose keys are dropped again.
    """

    def __init__(self, model):
        self.m = model
        d2t = getattr(model, "d2t", None)
        self.d2t = d2t.long() if d2t is not None else None
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache, self.done = DynamicCache(), 0

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.d2t[idx] if self.d2t is not None else idx

    def _fuse(self, aux: torch.Tensor) -> torch.Tensor:
        m, h = self.m, aux.float()
        if m.input_norm is not None:
            h = m.input_norm(h)
        if m.fc_norm is not None:
            h = torch.cat([nm(c) for nm, c in zip(m.fc_norm, h.chunk(len(m.fc_norm), dim=-1))], dim=-1)
        return m.fc(h)

    def _step(self, ids, h, pos, cache_pos, mask):
        m = self.m
        x = torch.cat([m.embed_tokens(ids), h], dim=-1)
        pe = m.rotary_emb(x, pos)
        for layer in m.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                      cache_position=cache_pos, position_embeddings=pe)
        if m.config.norm_output:
            x = m.norm(x)
            logits = m.lm_head(x[:, -1])
        else:
            logits = m.lm_head(m.norm(x[:, -1]))
        return x[:, -1:], int(self._to_target(logits.argmax(-1))[0])

    @torch.inference_mode()
    def propose(self, aux: torch.Tensor, next_ids: list[int], k: int) -> list[int]:
        """aux: [1, n, L*H] verifier states g_0..g_{n-1}; next_ids: x_1..x_n. Returns k target ids."""
        n, a = aux.shape[1], self.done
        ids = torch.tensor([next_ids[a:n]])
        pos = torch.arange(a + 1, n + 1).unsqueeze(0)  # shift_batch: positions start at 1
        # new queries a..n-1 see keys 0..their own position (training's causal document mask)
        mask = (torch.arange(n)[None, :] <= torch.arange(a, n)[:, None])[None, None]
        h, tok = self._step(ids, self._fuse(aux[:, a:n]), pos, torch.arange(a, n), mask)
        out = [tok]
        for step in range(1, k):  # one query at the last position, seeing every cached key
            h, tok = self._step(torch.tensor([[tok]]), h, torch.tensor([[n + step]]), torch.tensor([n + step - 1]),
                                None)
            out.append(tok)
        if k > 1:
            self.cache.crop(-(k - 1))  # drop the TTT steps' keys
        self.done = n
        return out


class Proposer(Protocol):
    """What speculative_generate drafts with: a DraftProposer, or a stand-in with propose() alone (reset() is
    called where there is one)."""

    def propose(self, aux: torch.Tensor, next_ids: list[int], k: int) -> list[int]: ...


def speculative_generate(verifier, proposer: Proposer, aux_ids: list[int], prompt: list[int],
                         k: int, max_new: int, eos: set[int], acc: Acceptance) -> list[int]:
    """Greedy chain speculative decoding; returns the generated ids (stopping at EOS, inclusive)."""
    from transformers import DynamicCache

    model = verifier
    cache = DynamicCache()
    if hasattr(proposer, "reset"):
        proposer.reset()
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)  # [1, n, L*H]
    nxt = int(out.logits[0, -1].argmax())
    tokens, gen = list(prompt), [nxt]
    while len(gen) < max_new and nxt not in eos:
        drafts = proposer.propose(feats, tokens[1:] + [nxt], k)
        block = [nxt, *drafts]
        with torch.inference_mode():
            o = model(torch.tensor([block]), past_key_values=cache, use_cache=True, output_hidden_states=True)
        pred = o.logits[0].argmax(-1).tolist()
        a = 0
        while a < k and pred[a] == drafts[a]:
            a += 1
        acc.add(a, len(gen))
        new = drafts[:a] + [pred[a]]
        if a < k:  # drop the rejected drafts' keys
            cache.crop(-(k - a))
        feats = torch.cat([feats, torch.cat([o.hidden_states[i] for i in aux_ids], dim=-1)[:, : a + 1]], dim=1)
        tokens += [nxt, *drafts[:a]]
        for t in new:
            gen.append(t)
            if t in eos or len(gen) >= max_new:
                break
        acc.tokens += len(new)
        nxt = gen[-1]
    return gen[:max_new]


# -- prompts --------------------------------------------------------------------------------
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


# -- checks before any long work --------------------------------------------------------------
def check_draft_matches(recipe: Recipe, draft_cfg: dict, extraction_layers: list[int] | None, verifier_arch) -> None:
    aux = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux != recipe.aux_layer_ids:
        raise BadInput(f"draft aux layer ids {aux} != recipe aux_layer_ids {recipe.aux_layer_ids}")
    if extraction_layers is not None and aux != extraction_layers[:-1]:
        raise BadInput(f"draft aux layer ids {aux} != the extraction's {extraction_layers[:-1]}")
    ver = (draft_cfg.get("speculators_config") or {}).get("verifier") or {}
    want = ver.get("architectures")
    if want and verifier_arch and list(want) != list(verifier_arch):
        raise BadInput(f"draft was trained for a {want} verifier, the recipe's verifier is {verifier_arch}")


# -- backends ----------------------------------------------------------------------------------
def evaluate_transformers(recipe: Recipe, draft_dir: Path, prompts: list[list[dict]], untrained: bool,
                          max_new: int | None = None) -> dict:
    """τ of a draft in this process's loop at evaluate.k, max_new (default evaluate.max_new_tokens) a prompt."""
    from eagle_jobs.verifier import load_verifier

    v = load_verifier(recipe.verifier)
    proposer = DraftProposer(load_draft(draft_dir, v.path, untrained=untrained, seed=recipe.train.seed))
    k = recipe.evaluate.k
    acc = Acceptance(k)
    eos_id = v.model.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id or v.tokenizer.eos_token_id])
    outputs = []
    kw = recipe.chat.template_kwargs()
    label = "evaluate (untrained draft)" if untrained else "evaluate"
    with stage_progress(label, len(prompts), "prompts") as advance:
        for msgs in prompts:
            prompt = prompt_ids(v.tokenizer, msgs, kw)
            before = acc.tokens
            gen = speculative_generate(v.model, proposer, recipe.aux_layer_ids, prompt, k,
                                       max_new or recipe.evaluate.max_new_tokens, eos, acc)
            outputs.append(gen)
            advance(1, acc.tokens - before)
    return {"acceptance_length": acc.tau, "per_position_acceptance": acc.per_position(), "rounds": acc.rounds,
            "tokens_generated": sum(len(g) for g in outputs), "outputs": outputs,
            "by_position": by_position(acc.steps, recipe.evaluate.position_bucket_tokens),
            "engine": engine_record(recipe, attention=getattr(v.model.config, "_attn_implementation", None))}


# -- the engine that measured τ ------------------------------------------------------------------
# What vLLM does with an EAGLE-3 draft that our --speculative-config leaves to its defaults (vllm 0.32
# config/speculative.py:529 rejection_sample_method, :600 draft_sample_method): in effect in every τ.
VLLM_SPEC_DEFAULTS = {"rejection_sample_method": "standard", "draft_sample_method": "greedy"}
# What the server's log says it chose (vllm 0.32 v1/worker/gpu_worker.py:518 and cpu_worker.py:162 log
# the V2 runner; platforms/cuda.py:446,507 and cpu.py:163,175 the attention backend, CPU_ATTN unlogged).
_V2_RUNNER = "Using V2 Model Runner"
_ATTENTION = re.compile(r"Using (\w+) (?:attention )?backend")


NOT_SEEN = "not seen: an external server (its own log says)"


def _log_since(log: Path, offset: int) -> str:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def engine_record(recipe: Recipe, base: str | None = None, log_text: str | None = None,
                  attention: str | None = None) -> EngineRecord:
    """The engine a τ was measured on: base, a vLLM server (its /version; runner and attention backend
    from log_text, its log, where this process started it); None, this process's transformers loop."""
    ev = recipe.evaluate
    sampling = {"temperature": 0.0, "max_tokens": ev.max_new_tokens,
                "chat_template_kwargs": recipe.chat.template_kwargs()}
    if base is None:
        import transformers

        rec = {"engine": "transformers",
               "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
               "model_runner": "eagle-jobs greedy chain loop (evaluate.speculative_generate)",
               "attention_backend": attention or "sdpa", "spec_method": "eagle3",
               "spec_settings": {"num_speculative_tokens": ev.k,
                                 "acceptance": "a draft token counts while it equals the verifier's argmax"},
               "sampling": sampling}
    else:
        import httpx

        version = httpx.get(f"{base}/version", timeout=30).json()["version"]  # serve/instrumentator/basic.py:53
        found = _ATTENTION.search(log_text or "")
        rec = {"engine": "vllm", "version": str(version),
               "model_runner": NOT_SEEN if log_text is None else "V2" if _V2_RUNNER in log_text else "V1",
               "attention_backend": (NOT_SEEN if log_text is None
                                     else found.group(1) if found else "the platform's default (not logged)"),
               "spec_method": "eagle3",
               "spec_settings": {"num_speculative_tokens": ev.k, **VLLM_SPEC_DEFAULTS},
               "sampling": sampling}
    return cast(EngineRecord, {**rec, "key": content_hash(rec, 16)})


def describe_engine(e: EngineRecord | dict | None) -> str:
    if not e:
        return "an engine it does not name (its record has no `engine`)"
    return (f"{e['engine']} {e['version']}, runner {e['model_runner']}, attention {e['attention_backend']}, "
            f"{e['spec_method']} {e['spec_settings']}")


_METRIC = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')


def parse_spec_metrics(text: str) -> dict:
    """The vllm:spec_decode_* counters (vllm/v1/spec_decode/metrics.py) from a /metrics page."""
    out: dict = {"per_pos": {}}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos_label = re.search(r'position="(\d+)"', labels)
            assert pos_label is not None, f"vLLM labels each per-position count with its position: {line}"
            pos = int(pos_label.group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + val
        else:
            out[name.removeprefix("vllm:spec_decode_")] = out.get(name.removeprefix("vllm:spec_decode_"), 0.0) + val
    return out


def evaluate_vllm(recipe: Recipe, draft_dir: Path, prompts: list[list[dict]]) -> dict:
    return evaluate_vllm_sets(recipe, draft_dir, {"prompts": prompts})["prompts"]


def chat_body(recipe: Recipe, model: str, msgs: list[dict], max_tokens: int | None = None) -> dict:
    """One evaluation request: greedy, the recipe's chat template arguments, max_tokens (default
    evaluate.max_new_tokens)."""
    kw = recipe.chat.template_kwargs()
    return {"model": model, "messages": msgs, "max_tokens": max_tokens or recipe.evaluate.max_new_tokens,
            "temperature": 0.0, **({"chat_template_kwargs": kw} if kw else {})}


def served_model(base: str) -> str:
    import httpx

    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def spec_counters(base: str) -> dict:
    import httpx

    return parse_spec_metrics(httpx.get(f"{base}/metrics", timeout=30).text)


def drafts_and_accepted(before: dict, after: dict) -> tuple[float, float]:
    """Drafts and accepted draft tokens between two reads of the /metrics counters (server-wide)."""
    return (after.get("num_drafts", 0) - before.get("num_drafts", 0),
            after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0))


def request_steps(body: dict) -> list[tuple[int, int]] | None:
    """A chat response's verify steps (--per-request-spec-decode-metrics detailed), or None where the
    server does not give them. vLLM leaves per_step_accepted out when a request had no verify step."""
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if spec is None or ("per_step_accepted" not in spec and spec.get("num_spec_steps")):
        return None
    return steps_of_request(spec.get("per_step_accepted") or [])


def tau_pass(recipe: Recipe, base: str, model: str, name: str, prompts: list[list[dict]]) -> dict:
    """One set's τ on a draft's server: the /metrics counters read before and after it (server-wide:
    every request of the set ends before `after` is read), and its τ by output position."""
    import httpx

    k, max_tokens = recipe.evaluate.k, max_tokens_of(recipe, name)

    def complete(msgs, c):
        r = c.post(f"{base}/v1/chat/completions", json=chat_body(recipe, model, msgs, max_tokens))
        r.raise_for_status()
        body = r.json()
        return body["usage"]["completion_tokens"], request_steps(body)

    before, tokens = spec_counters(base), 0
    steps: list[tuple[int, int]] | None = []
    with httpx.Client(timeout=recipe.evaluate.vllm.request_timeout_s) as c, \
            ThreadPoolExecutor(recipe.evaluate.concurrency) as pool, \
            stage_progress(f"evaluate (vllm): {name}", len(prompts), "prompts") as advance:
        for fut in as_completed([pool.submit(complete, msgs, c) for msgs in prompts]):
            n, request = fut.result()
            tokens += n
            steps = None if steps is None or request is None else steps + request
            advance(1, n)
    after = spec_counters(base)
    drafts, accepted = drafts_and_accepted(before, after)
    per_pos = [(after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0)) / drafts if drafts else 0.0
               for i in range(k)]
    return {"acceptance_length": 1 + accepted / drafts if drafts else 1.0, "per_position_acceptance": per_pos,
            "rounds": int(drafts), "tokens_generated": tokens, "outputs": [],
            "by_position": None if steps is None else by_position(steps, recipe.evaluate.position_bucket_tokens)}


def evaluate_vllm_sets(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]],
                       timed: bool = False, k: int | None = None, tau: bool = True) -> dict[str, dict]:
    """One server for every set, the draft at k (default evaluate.k). tau: each set's τ (tau_pass).
    timed: first time each set but the long-output one at each concurrency level (measure_speed), as
    out[set]["speed"]."""
    from eagle_jobs.vllm_server import server_log, vllm_endpoint

    k = k or recipe.evaluate.k
    log = server_log(None, f"port-{recipe.evaluate.vllm.port}")  # vllm_endpoint's own choice, appended to
    ended = log.stat().st_size if log.is_file() else 0  # a server started here writes after this
    with vllm_endpoint(evaluate_plan(recipe, draft_dir, k), log) as base:
        model = served_model(base)
        engine = engine_record(recipe, base, _log_since(log, ended) if own_servers(recipe) else None)
        sets, too_long = within_limits(recipe, sets, served_token_count(recipe, base, model))
        # timed before the τ pass, so that neither this server nor the one without a draft has seen the
        # timed prompts before (vLLM's prefix cache would shorten their prefill on one side only)
        started = time.perf_counter()
        speed = measure_speed(recipe, base, model, timed_sets(sets), f"with the draft at k={k}", True) if timed else {}
        speed_wall_s = time.perf_counter() - started
        return {name: {**(tau_pass(recipe, base, model, name, prompts) if tau else {}),
                       "speed": speed.get(name), "speed_wall_s": speed_wall_s, "prompts": prompts,
                       "skipped_too_long": too_long[name], "engine": engine}
                for name, prompts in sets.items()}


def timed_sets(sets: dict[str, list[list[dict]]]) -> dict[str, list[list[dict]]]:
    """The sets the speed pass times: all but the long-output set, whose answers are for τ by position."""
    return {name: m for name, m in sets.items() if name != LONG_OUTPUT_SET}


# -- speed: output tokens per second with the draft over without it -------------------------------
WARM_UP = [{"role": "user", "content": "Count from one to twenty in words, one number per line."}]


def stream_chat(client, base: str, body: dict) -> tuple[int, float]:
    """One streamed chat request: (output tokens, seconds to its first chunk).

    vLLM sends a request's first chunk (its role) when the engine returns the request's first output,
    i.e. after prefill and the first token (OpenAIServingChat.chat_completion_stream_generator,
    `first_iteration`, vllm/entrypoints/openai/chat_completion/serving.py); the token count is the
    usage chunk that stream_options.include_usage adds at the end."""
    start, ttft, tokens = time.perf_counter(), None, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise Unavailable(f"{base}/v1/chat/completions: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise Unavailable(f"{base}/v1/chat/completions: {chunk['error']}")
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens is None or ttft is None:
        raise Unavailable(f"{base}/v1/chat/completions: the stream ended without a token or its usage")
    return tokens, ttft


def timed_pass(recipe: Recipe, base: str, bodies: list[dict], concurrency: int) -> TimedPass:
    """`concurrency` requests in flight until every body is answered (each worker sends its next request
    as its last one ends). Output tokens per second over the pass's wall time, and each request's TTFT."""
    import httpx

    timeout = httpx.Timeout(recipe.evaluate.vllm.request_timeout_s, connect=30)
    with httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as c, \
            ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda b: stream_chat(c, base, b), bodies))
        seconds = time.perf_counter() - start
    tokens, ttft = sum(a[0] for a in answers), sorted(a[1] for a in answers)
    return TimedPass(requests=len(bodies), output_tokens=tokens, seconds=seconds,
                     output_tokens_per_s=tokens / seconds, ttft_s_mean=sum(ttft) / len(ttft),
                     ttft_s_p50=statistics.median(ttft), ttft_s_max=ttft[-1], acceptance_length=None)


def measure_speed(recipe: Recipe, base: str, model: str, sets: dict[str, list[list[dict]]],
                  label: str, drafted: bool = False) -> dict[str, dict[int, TimedPass]]:
    """Every set at every evaluate.concurrency_levels, after a warm-up that is not counted. Each level
    takes the set's next prompts (distinct while the set lasts), so no level finds its prompts cached.
    drafted: each pass's τ too, from the /metrics counters around it."""
    ev = recipe.evaluate
    top = max(ev.concurrency_levels)
    timed_pass(recipe, base, [chat_body(recipe, model, WARM_UP)] * top, top)  # one-off first-request costs
    out: dict[str, dict[int, TimedPass]] = {}
    for name, prompts in sets.items():
        offset, out[name] = 0, {}
        for level in ev.concurrency_levels:
            n = ev.speedup_requests_at(level)
            bodies = [chat_body(recipe, model, prompts[(offset + i) % len(prompts)]) for i in range(n)]
            offset += n
            before = spec_counters(base) if drafted else None
            t = out[name][level] = timed_pass(recipe, base, bodies, level)
            if before is not None:
                drafts, accepted = drafts_and_accepted(before, spec_counters(base))
                t["acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
            console.print(f"  speed {label}: {name}, concurrency {level}: {n} requests, {t['output_tokens']} tokens "
                          f"in {t['seconds']:.1f} s = {t['output_tokens_per_s']:.1f} tokens/s, "
                          f"TTFT {t['ttft_s_mean']:.2f} s", soft_wrap=True, markup=False, highlight=False)
    return out


def speed_without_draft(recipe: Recipe, sets: dict[str, list[list[dict]]]) -> dict[str, dict[int, TimedPass]]:
    """The same timed passes on a server with the same serve_args and no --speculative-config. A second
    process: vLLM 0.32 fixes speculative decoding per engine (VllmConfig.speculative_config, built once
    from --speculative-config) and has no request field or batch-size rule that turns it off."""
    from eagle_jobs.vllm_server import vllm_endpoint

    with vllm_endpoint(evaluate_plan(recipe, None)) as base:
        return measure_speed(recipe, base, served_model(base), sets, "without a draft")


def speedup_table(by_k: dict[int, dict[int, TimedPass]], without: dict[int, TimedPass] | None,
                  recipe: Recipe) -> SpeedTable | None:
    """One set's speed per draft length and concurrency level: with and without the draft, and their ratio."""
    if not by_k or not without:
        return None
    surface = [SpeedLevel(k=k, concurrency=lv, requests=w["requests"], with_draft=w, without_draft=without[lv],
                          speedup=w["output_tokens_per_s"] / without[lv]["output_tokens_per_s"])
               for k in sorted(by_k) for lv, w in by_k[k].items()]
    return SpeedTable(max_tokens=recipe.evaluate.max_new_tokens,
                      levels=[c for c in surface if c["k"] == recipe.evaluate.k], surface=surface)


def teacher_forced_estimate(metrics: list[dict], k: int, epoch: int | None = None) -> float | None:
    """1 + sum_i P(first i+1 draft steps all right), from the validation of `epoch` (the exported one:
    the draft being evaluated), else of the last epoch validated."""
    vals = [m for m in metrics if "val" in m]
    if epoch is not None and any(int(m.get("epoch", -1)) == epoch for m in vals):
        vals = [m for m in vals if int(m.get("epoch", -1)) == epoch]
    if not vals:
        return None
    last = vals[-1]["val"]
    accs = [last.get(f"full_acc_{i}_epoch") for i in range(k)]
    accs = [a for a in accs if a is not None]
    return 1 + sum(accs) if accs else None


SPEED_NOTE = ("output tokens per second of streamed greedy chat requests with the draft over without it, each "
              "concurrency level a closed loop of that many requests in flight, after an uncounted warm-up; the "
              "server without the draft is started with the same serve_args and no --speculative-config")


def own_servers(recipe: Recipe) -> bool:
    """Whether evaluate starts its vLLM servers itself: no endpoint in the recipe, no pod sidecar
    ($EAGLE_JOBS_VLLM_ENDPOINT, components/vllm-sidecar)."""
    import os

    return not (recipe.evaluate.vllm.endpoint or os.environ.get("EAGLE_JOBS_VLLM_ENDPOINT"))


def measure_draft(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]],
                  timed: bool = False) -> tuple[dict, dict[str, int], dict[str, dict]]:
    """One draft's results per set on the recipe's backend: (prompts kept per set, prompts skipped as too
    long per set, results). The transformers backend counts prompt lengths with the verifier's tokenizer
    first; the vLLM backend on its server (served_token_count), where the verifier's own code may run.
    timed (vLLM): the speed pass too (evaluate_vllm_sets)."""
    if recipe.evaluate.backend == "transformers":
        kept, too_long = within_limits(recipe, sets)
        return kept, too_long, {name: evaluate_transformers(recipe, draft_dir, m, untrained=False,
                                                            max_new=max_tokens_of(recipe, name))
                                for name, m in kept.items()}
    res = evaluate_vllm_sets(recipe, draft_dir, sets, timed=timed)
    return ({name: r["prompts"] for name, r in res.items()}, {name: r["skipped_too_long"] for name, r in res.items()},
            res)


def measure_sets(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]], work: Path):
    """τ of the draft and of an untrained one per set, and the speedup per set where it can be measured:
    (prompts kept per set, prompts skipped as too long per set, draft's results, untrained draft's results,
    {"sets": set -> speedup table, "note", "wall_s"}). The long-output set is for τ by position: no
    untrained baseline and no speed pass there."""
    vllm, own = recipe.evaluate.backend == "vllm", own_servers(recipe)
    sets, too_long, res = measure_draft(recipe, draft_dir, sets, timed=vllm and own)
    if not vllm:
        base = {name: evaluate_transformers(recipe, draft_dir, m, untrained=True)
                for name, m in timed_sets(sets).items()}
        return sets, too_long, res, base, {
            "sets": {}, "wall_s": None, "note": "not measured: speed is a serving measure, taken on the vllm "
            "backend (the transformers loop runs one request at a time, unbatched)"}
    # The baseline and the speed without a draft need servers of their own: possible when this stage
    # starts vLLM itself, not when a sidecar serves the trained draft for the whole pod.
    if not own:
        return sets, too_long, res, {}, {
            "sets": {}, "wall_s": None, "note": "not measured: the pod's vLLM sidecar serves only the trained "
            "draft, and a server without it cannot start beside it"}
    from eagle_jobs.verifier import resolve_path

    untrained = work / "untrained-draft"
    load_draft(draft_dir, resolve_path(recipe.verifier, "embeddings"), untrained=True,
               seed=recipe.train.seed).to(torch.bfloat16).save_pretrained(untrained)
    timed = timed_sets(sets)
    base = evaluate_vllm_sets(recipe, untrained, timed)
    started = time.perf_counter()
    by_k = {recipe.evaluate.k: {name: res[name]["speed"] for name in timed}}
    for k in recipe.evaluate.num_speculative_tokens:  # every other k: a server each, timed only
        if k != recipe.evaluate.k:
            by_k[k] = {name: r["speed"] for name, r in evaluate_vllm_sets(recipe, draft_dir, timed, True, k,
                                                                          tau=False).items()}
    plain = speed_without_draft(recipe, timed)
    wall = time.perf_counter() - started + next(iter(res.values()))["speed_wall_s"]
    return sets, too_long, res, base, {
        "sets": {name: speedup_table({k: s[name] for k, s in by_k.items()}, plain[name], recipe) for name in timed},
        "note": SPEED_NOTE, "wall_s": wall}


def tau_on_this_engine(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]]) -> tuple[EngineRecord, dict]:
    """One draft's τ per set on this process's engine (the recipe's evaluate backend), without baseline or
    speed pass: (engine, {set: {acceptance_length, prompts_sha256}}), what promote --across-engines compares."""
    kept, _, res = measure_draft(recipe, draft_dir, sets)
    return next(iter(res.values()))["engine"], {
        name: {"acceptance_length": r["acceptance_length"], "prompts_sha256": content_hash(kept[name])}
        for name, r in res.items()}


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


def set_results(recipe: Recipe, prompts: Path | None, sets: dict[str, list[list[dict]]], too_long: dict[str, int],
                res: dict, base: dict, speed: dict) -> dict[str, PromptSetResult]:
    """Each set's record in report.json, from measure_sets' results."""
    return {name: {
        "acceptance_length": res[name]["acceptance_length"],
        "per_position_acceptance": res[name]["per_position_acceptance"],
        "num_prompts": len(m), "skipped_too_long": too_long[name],
        "tokens_generated": res[name]["tokens_generated"], "verifier_forwards": res[name]["rounds"],
        "max_new_tokens": max_tokens_of(recipe, name), "by_position": res[name].get("by_position"),
        "baseline_acceptance_length": base[name]["acceptance_length"] if name in base else None,
        "baseline_per_position_acceptance": base[name]["per_position_acceptance"] if name in base else None,
        "source": set_source(recipe, name, prompts),
        # what `promote` compares: drafts are ranked only on the same prompts
        "prompts_sha256": content_hash(m),
        # output tokens/s with the draft over without it, per concurrency level (None: not measured)
        "speedup": speed["sets"].get(name),
    } for name, m in sets.items()}


def run_evaluate(recipe: Recipe, store: Store, run_id: str, prompts: Path | None = None,
                 output: Path | None = None, variant: str | None = None) -> EvalReport:
    """tau (and speed) of the run's final draft, or of one `compare` variant's, on every prompt set."""
    from eagle_jobs.verifier import load_config

    sets = eval_sets(recipe, prompts)  # bad prompt files fail here, before any model loads
    work = Path(tempfile.mkdtemp(prefix="eagle-eval-"))
    draft_dir = download_final(store, run_id, work / "draft", variant)
    draft_cfg = json.loads((draft_dir / "config.json").read_text())
    try:
        layers = extraction_info(store, run_id)["layer_ids"]
    except Exception:  # noqa: BLE001 - a draft evaluated without its extraction in this store
        layers = None
    check_draft_matches(recipe, draft_cfg, layers, getattr(load_config(recipe.verifier), "architectures", None))
    train_cfg = json.loads((draft_dir / "train_config.json").read_text())
    metrics = json.loads((draft_dir / "metrics.json").read_text())
    k = recipe.evaluate.k
    console.print(f"[bold]evaluate[/] k={k}, backend {recipe.evaluate.backend}: "
                  + ", ".join(f"{name} ({len(m)} prompts)" for name, m in sets.items()))
    sets, too_long, res, base, speed = measure_sets(recipe, draft_dir, sets, work)
    per_set = set_results(recipe, prompts, sets, too_long, res, base, speed)
    primary = next(iter(per_set))  # the held-out split when there is one
    p = per_set[primary]
    report: EvalReport = {
        "acceptance_length": p["acceptance_length"], "per_position_acceptance": p["per_position_acceptance"],
        "num_speculative_tokens": k, "num_prompts": p["num_prompts"], "tokens_generated": p["tokens_generated"],
        "verifier_forwards": p["verifier_forwards"], "verifier": recipe.verifier.model,
        "draft": store.url(Stage(store, run_id, train_dir(variant)).key("data/final")),
        "baseline_acceptance_length": p["baseline_acceptance_length"],
        "baseline_per_position_acceptance": p["baseline_per_position_acceptance"],
        "baseline_note": ("the same loop with an untrained draft (same shape, vocab mapping and verifier embeddings)"
                          if base else "not measured: the pod's vLLM sidecar serves only the trained draft"),
        "speedup": p["speedup"], "speedup_note": speed["note"], "speedup_wall_s": speed["wall_s"],
        "speed_ks": recipe.evaluate.num_speculative_tokens,
        "concurrency_levels": recipe.evaluate.concurrency_levels, "min_speedup": recipe.evaluate.min_speedup,
        "position_bucket_tokens": recipe.evaluate.position_bucket_tokens,
        "trained_answer_tokens": recipe.sampling.max_new_tokens,
        "serving": advise(recipe, {name: x["speedup"] for name, x in per_set.items()}),
        "teacher_forced_estimate": teacher_forced_estimate(
            metrics, k, (train_cfg.get("selection") or {}).get("epoch")),
        "teacher_forced_note": "1 + sum of the exported epoch's validation full_acc_i: an estimate, not a measurement",
        "backend": recipe.evaluate.backend, "engine": res[primary]["engine"],
        "prompts": primary if not prompts else str(prompts),
        "prompts_sha256": p["prompts_sha256"], "prompt_sets": per_set,
        "train": {k2: train_cfg.get(k2) for k2 in ("samples", "epochs", "total_steps", "parameters", "selection")},
        "run_id": run_id,
    }
    from eagle_jobs.report import write_report

    files = write_report(report, metrics)
    stage = Stage(store, run_id, eval_dir(variant))
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (output / name).write_bytes(data)
        where = str(output / "report.md")
    else:
        stage.commit_shard("report", files, {"acceptance_length": report["acceptance_length"]})
        stage.complete({"acceptance_length": report["acceptance_length"]})
        where = store.url(stage.key("data/report.md"))
    for name, x in per_set.items():
        # no [brackets]: rich would read them as markup and print nothing of the set's name
        sp = "; speedup " + ", ".join(f"{lv['speedup']:.2f}x at concurrency {lv['concurrency']}"
                                      for lv in x["speedup"]["levels"]) if x["speedup"] else ""
        console.print(f"  {name}: tau = {x['acceptance_length']:.3f} on {x['num_prompts']} prompts (untrained draft: "
                      f"{x['baseline_acceptance_length'] or float('nan'):.3f}){sp}", soft_wrap=True)
    if report["serving"]:
        console.print(f"  serving config: {report['serving']['note']} (report.md, 'Serve this draft')",
                      soft_wrap=True, markup=False, highlight=False)
    console.print(f"  report: {where}")
    return report
