"""Every stage's `vllm serve` plan, built in one place (below the stages).

A plan is the recipe's server section for the stage, the verifier, and what the stage adds to
`vllm serve` (its `serve_args`), as a `vllm_server.ServePlan` with its command and environment.
The stage's own server runs it on CPU; in a pod, the prepare init container (`eagle-jobs serve-vllm
--write`) builds the same plan for the vLLM sidecar. Building a plan imports neither torch nor
transformers (unless the recipe leaves the verifier's layer count to its config), so a pod's
prepare container does not pay for them before vLLM can start.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle_jobs import vllm_cpu
from eagle_jobs.draft import stored_layer_ids
from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe
from eagle_jobs.settings import settings
from eagle_jobs.store import Store
from eagle_jobs.vllm_server import ServePlan


def capture_plan(recipe: Recipe) -> ServePlan:
    """capture: the recipe's capture.vllm and the verifier, with the recipe's reasoning parser unless
    capture.vllm.serve_args name one."""
    parser = recipe.chat.reasoning_parser
    if parser is None or "--reasoning-parser" in recipe.capture.vllm.serve_args:
        return ServePlan(recipe.capture.vllm, recipe.verifier, ())
    return ServePlan(recipe.capture.vllm, recipe.verifier, ("--reasoning-parser", parser))


def extract_args(recipe: Recipe, run_id: str, worker: int) -> list[str]:
    """What extract adds to `vllm serve`: vLLM's extract_hidden_states with a connector writing to scratch.

    Always bf16 from vLLM (the model dtype): with storage_dtype fp8 the shard encoder quantises once,
    per token and layer. hs-connectors' fp8 connector would quantise first with one scale per token
    over all layers, and ours would quantise again.
    """
    n_layers = recipe.verifier.num_layers
    if n_layers is None:
        from eagle_jobs.verifier import num_layers

        n_layers = num_layers(recipe.verifier)
    layer_ids = stored_layer_ids(recipe.aux_layer_ids, n_layers)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {**vllm_cpu.hidden_states_connector(), "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(extract_scratch(recipe, run_id, worker))}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-chunked-prefill"]


def extract_scratch(recipe: Recipe, run_id: str, worker: int) -> Path:
    """Where vLLM's connector writes and the extract worker reads (shared with the vLLM sidecar)."""
    p = Path(recipe.extract.scratch_dir) / f"{run_id}-{worker}"
    p.mkdir(parents=True, exist_ok=True)
    return p


def extract_plan(recipe: Recipe, run_id: str, worker: int) -> ServePlan:
    """extract, for one worker: the recipe's extract.vllm, the verifier, and extract_args."""
    return ServePlan(recipe.extract.vllm, recipe.verifier, tuple(extract_args(recipe, run_id, worker)))


def speculative_config(draft: str, k: int) -> dict:
    """The --speculative-config of an EAGLE-3 draft at draft length k: what evaluate serves and what the
    report recommends deploying (eagle_jobs/deploy.py adds a batch-size schedule of k there)."""
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}


# Each response carries its verify steps' accepted counts in order (vllm 0.32 config/observability.py:50,
# v1/metrics/stats.py RequestSpecDecodeMetrics; the same in 0.33): τ by output position.
PER_REQUEST_SPEC_METRICS = ("--per-request-spec-decode-metrics", "detailed")


NO_DRAFT = "no-draft"


def plan_name(k: int | None, untrained: bool = False) -> str:
    """An evaluate server's name, by which the worker asks a pod's sidecar for it (eagle_jobs.vllm_switch)."""
    return NO_DRAFT if k is None else f"{'untrained' if untrained else 'draft'}-k{k}"


def evaluate_plan(recipe: Recipe, draft_dir: Path | None, k: int | None = None, untrained: bool = False) -> ServePlan:
    """evaluate: the recipe's evaluate.vllm and the verifier, with the draft as EAGLE-3 speculative
    decoding at draft length k (default evaluate.k), or, for the speed baseline (draft_dir None), without one.
    untrained: the draft is the τ baseline (it names the plan)."""
    if draft_dir is None:
        return ServePlan(recipe.evaluate.vllm, recipe.verifier, (), NO_DRAFT)
    k = k or recipe.evaluate.k
    spec = speculative_config(str(draft_dir), k)
    return ServePlan(recipe.evaluate.vllm, recipe.verifier,
                     ("--speculative-config", json.dumps(spec), *PER_REQUEST_SPEC_METRICS), plan_name(k, untrained))


def sidecar_drafts() -> tuple[Path, Path]:
    """Where a pod's drafts are, on the volume its prepare, worker and vLLM sidecar share: the trained
    one (prepare downloads it) and the untrained one (the worker builds it before it asks for it)."""
    work = settings().work_dir or Path("/tmp")
    return work / "draft", work / "untrained-draft"


def evaluate_plans(recipe: Recipe, draft_dir: Path, untrained_dir: Path) -> dict[str, ServePlan]:
    """Every server evaluate starts, by name, in the order it starts them: the draft at evaluate.k, the
    untrained draft at evaluate.k, the draft at each other k of the speed pass, and no draft."""
    ev = recipe.evaluate
    plans = [evaluate_plan(recipe, draft_dir, ev.k), evaluate_plan(recipe, untrained_dir, ev.k, untrained=True),
             *(evaluate_plan(recipe, draft_dir, k) for k in ev.other_ks()),
             evaluate_plan(recipe, None)]
    return {p.name: p for p in plans}


def stage_plans(recipe: Recipe, stage: str, store: Store, run_id: str,
                shard_index: int | None = None) -> dict[str, ServePlan]:
    """The plans of one stage as the stage itself would start them, the first first: what a pod's vLLM
    sidecar runs. One for capture and extract; evaluate's every server (evaluate_plans)."""
    from eagle_jobs.sharding import worker_index

    if stage == "capture":
        return {"capture": capture_plan(recipe)}
    if stage == "extract":
        # the worker's scratch needs only its index: the sidecar is not told the shard count
        return {"extract": extract_plan(recipe, run_id, worker_index(shard_index))}
    if stage == "evaluate":
        from eagle_jobs.committed import download_final

        trained, untrained = sidecar_drafts()
        return evaluate_plans(recipe, download_final(store, run_id, trained), untrained)
    raise BadInput(f"serve-vllm --stage {stage}: choose capture, extract or evaluate")
