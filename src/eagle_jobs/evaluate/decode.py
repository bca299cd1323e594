"""The transformers backend: the draft at test time (speculators' Eagle3DraftModel modules) and greedy
chain speculative decoding on CPU, with the acceptance it counts (per draft position and by output
position)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import torch

from eagle_jobs.evaluate.engine import engine_record
from eagle_jobs.evaluate.sets import SetMeasurement, prompt_ids
from eagle_jobs.progress import stage_progress
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import PositionBucket


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
def load_draft(path: Path, verifier_path: str, untrained: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    """The trained draft from its checkpoint, or the same architecture untrained (baseline), in dtype."""
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
    return model.to(dtype).eval()


def save_untrained(draft_dir: Path, verifier_path: str, seed: int, out: Path) -> Path:
    """The τ baseline a vLLM server loads: the draft's architecture untrained (same shape, vocab mapping and
    verifier embeddings), built and saved in bf16. Built in bf16, not cast from fp32, because the Kimi-K2.5
    draft is 2.6 B parameters with the verifier's embeddings: 5.2 GB so, 10.4 GB in fp32, in a pod's worker
    beside its vLLM sidecar (k8s/components/vllm-sidecar sizes its memory)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = load_draft(draft_dir, verifier_path, untrained=True, seed=seed, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    return out


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
                         max_new: int, eos: set[int], acc: Acceptance) -> list[int]:
    """Greedy chain speculative decoding at `acc.k` draft tokens a step (the counter is sized for the k it
    counts); returns the generated ids (stopping at EOS, inclusive)."""
    from transformers import DynamicCache

    k = acc.k
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


# -- the backend ------------------------------------------------------------------------------
def evaluate_transformers(recipe: Recipe, draft_dir: Path, prompts: list[list[dict]], untrained: bool,
                          max_new: int | None = None) -> SetMeasurement:
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
            gen = speculative_generate(v.model, proposer, recipe.aux_layer_ids, prompt,
                                       max_new or recipe.evaluate.max_new_tokens, eos, acc)
            outputs.append(gen)
            advance(1, acc.tokens - before)
    return {"acceptance_length": acc.tau, "per_position_acceptance": acc.per_position(), "rounds": acc.rounds,
            "tokens_generated": sum(len(g) for g in outputs), "outputs": outputs,
            "by_position": by_position(acc.steps, recipe.evaluate.position_bucket_tokens),
            "engine": engine_record(recipe, attention=getattr(v.model.config, "_attn_implementation", None))}
