"""Stage 4, evaluate: mean acceptance length tau under greedy chain speculative decoding.

tau is tokens per verifier forward, bonus token included: vLLM's 1 + accepted/drafts.
Backends:
- transformers (decode.py): a real speculative decoding loop on CPU. Verifier prefill; the
  draft proposes k tokens from the verifier's fused aux states (its own hidden
  output feeding its next step, as at EAGLE-3 test time); the verifier checks
  them in one forward; the longest agreeing prefix plus the bonus token is kept.
  Its output equals plain greedy decoding of the verifier (tested).
- vllm (served.py): serve verifier + draft with --speculative-config and read the
  vllm:spec_decode_* counters from /metrics.
Also reported: the teacher-forced estimate from training's per-step accuracies,
and the same loop with an untrained draft, so the gain is visible.

The modules, each importing only those listed before it:
- sets.py: the prompt sets τ is measured on, and the prompts over limits.max_prompt_tokens left out.
- engine.py: a vLLM server as evaluate talks to it (request body, served model, /metrics counters), and
  the record of the engine a τ was measured on.
- decode.py: the transformers backend: the draft at test time and the speculative decoding loop.
- speed.py: the speed pass: timed streamed passes per concurrency level, with the draft and without it.
- served.py: the vLLM backend: one server a draft, each set's speed pass then its τ pass.
- run.py: the stage: checks, every set on the recipe's backend, the untrained baseline, the report.
"""
