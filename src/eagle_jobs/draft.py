"""The draft's shape and its fit on the verifier, checked from configs alone.

Runs before any weights load: aux layer ids out of range, or a draft that
cannot sit on the verifier, are rejected with the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe


@dataclass(frozen=True)
class DraftShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    verifier_vocab_size: int
    verifier_num_layers: int
    derived: tuple[str, ...] = ()

    def describe(self) -> str:
        d = asdict(self)
        d.pop("derived")
        s = ", ".join(f"{k}={v}" for k, v in d.items())
        return s + (f" (derived: {', '.join(self.derived)})" if self.derived else "")


def check_aux_ids(aux: list[int], verifier_layers: int, where: str = "aux_layer_ids") -> None:
    bad = [i for i in aux if not 1 <= i < verifier_layers]
    if bad:
        raise BadInput(f"{where} {aux}: {bad} out of range for a verifier with {verifier_layers} layers "
                       f"(ids are inputs of decoder layers 1..{verifier_layers - 1}; "
                       "the final layer is added by itself)")


def stored_layer_ids(aux: list[int], verifier_layers: int) -> list[int]:
    """What extraction stores: the aux ids, then the final layer (vLLM's id N)."""
    return [*aux, verifier_layers]


def resolve_shape(recipe: Recipe, text_cfg) -> DraftShape:
    d = recipe.draft
    n_layers = int(text_cfg.num_hidden_layers)
    check_aux_ids(recipe.aux_layer_ids, n_layers)
    vh, vocab = int(text_cfg.hidden_size), int(text_cfg.vocab_size)
    derived = []
    hidden = d.hidden_size or vh
    if d.hidden_size is None:
        derived.append("hidden_size")
    if hidden != vh:
        raise BadInput(f"draft.hidden_size {hidden} != verifier hidden size {vh}: "
                       "EAGLE-3 fuses the verifier's states at its own width")
    heads = d.num_attention_heads
    if heads is None:
        heads = int(getattr(text_cfg, "num_attention_heads", 0) or max(1, hidden // 128))
        derived.append("num_attention_heads")
    head_dim = d.head_dim
    if head_dim is None:
        if hidden % heads:
            raise BadInput(f"draft: hidden {hidden} is not divisible by {heads} heads; set draft.head_dim")
        head_dim = hidden // heads
        derived.append("head_dim")
    kv = d.num_key_value_heads
    if kv is None:
        vkv = getattr(text_cfg, "num_key_value_heads", None)
        kv = int(vkv) if vkv and heads % int(vkv) == 0 and not hasattr(text_cfg, "kv_lora_rank") else heads
        derived.append("num_key_value_heads")
    if heads % kv:
        raise BadInput(f"draft.num_attention_heads {heads} is not divisible by num_key_value_heads {kv}")
    inter = d.intermediate_size
    if inter is None:
        inter = int(getattr(text_cfg, "intermediate_size", 0) or 3 * hidden)
        derived.append("intermediate_size")
    if d.draft_vocab_size > vocab:
        raise BadInput(f"draft.draft_vocab_size {d.draft_vocab_size} > verifier vocab {vocab}")
    return DraftShape(d.num_layers, hidden, heads, kv, head_dim, inter, d.draft_vocab_size, vocab, n_layers,
                      tuple(derived))


def layer_config(shape: DraftShape, recipe: Recipe, text_cfg, attn_impl: str):
    """The draft decoder's transformer_layer_config: draft.architecture's config class (LlamaConfig or
    Qwen3Config, speculators' train/cli.py DRAFT_ARCH_CONFIGS), the two vLLM's eagle3 serves."""
    from transformers import LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[recipe.draft.architecture]
    rope = getattr(text_cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    rope = {k: v for k, v in dict(rope).items() if k not in ("type", "mrope_interleaved", "partial_rotary_factor")}
    sliding = recipe.draft.sliding_window
    layer_types = ["sliding_attention" if sliding else "full_attention"] * shape.num_layers
    cfg = config_class(
        vocab_size=shape.verifier_vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, hidden_act=getattr(text_cfg, "hidden_act", "silu") or "silu",
        max_position_embeddings=int(getattr(text_cfg, "max_position_embeddings", 4096)),
        rms_norm_eps=float(getattr(text_cfg, "rms_norm_eps", 1e-6)),
        initializer_range=float(getattr(text_cfg, "initializer_range", 0.02)), tie_word_embeddings=False,
        sliding_window=sliding, use_sliding_window=bool(sliding), layer_types=layer_types,
        # vLLM sizes the served draft's fc from this, and for 3 aux states without it (llama_eagle3.py)
        num_aux_hidden_states=len(recipe.aux_layer_ids),
    )
    cfg.rope_parameters = rope
    cfg._attn_implementation = attn_impl  # noqa: SLF001 - the seed's missing setting
    return cfg


def build_draft_model(shape: DraftShape, recipe: Recipe, text_cfg, attn_impl: str, t2d, d2t):
    """speculators' Eagle3DraftModel (fp32 master weights): draft.architecture's layer and draft.norms'
    switches, passed as speculators' own training arguments, on the recipe's verifier."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle_jobs.verifier import resolve_path

    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config(shape, recipe, text_cfg, attn_impl), t2d=t2d, d2t=d2t,
        target_layer_ids=recipe.aux_layer_ids, verifier_name_or_path=resolve_path(recipe.verifier, "embeddings"),
        draft_vocab_size=shape.draft_vocab_size, **recipe.draft.norms.model_dump(),
        ttt_steps=recipe.train.ttt_steps, draft_attn_impl=attn_impl,
        # speculators reads the verifier's config for its layer count (models/utils.py
        # resolve_target_layer_ids): as transformers' own class, never the repository's code (verifier.py)
        trust_remote_code=False,
    )


def loss_implementation(recipe: Recipe, gpu: bool) -> str:
    """train.loss.implementation resolved: fused Triton kernels on a GPU, eager PyTorch on CPU."""
    impl = recipe.train.loss.implementation
    impl = impl if impl != "auto" else ("fused" if gpu else "eager")
    if impl == "fused" and not gpu:
        raise BadInput("train.loss.implementation fused runs speculators' Triton kernels, which need a GPU: "
                       "use auto or eager on CPU (the same losses, tests/test_train.py)")
    return impl


def trainer_call_kwargs(recipe: Recipe, loss_impl: str) -> tuple[dict, dict]:
    """What speculators' Trainer passes to the draft's forward: ttt_steps, the per-step decay and the
    loss config, from speculators' own Eagle3DraftModel.get_trainer_kwargs."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle_jobs.speculators_compat import with_loss_parameters

    loss = recipe.train.loss
    kwargs = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=recipe.train.ttt_steps,
                                                 ttt_step_loss_decay=loss.step_decay, loss_fn=loss.spec(),
                                                 loss_implementation=loss_impl)
    for kw in kwargs:
        kw["loss_config"] = with_loss_parameters(kw["loss_config"], eta=loss.eta)
    return kwargs


def optimizer_settings(recipe: Recipe) -> dict:
    """speculators' TrainerConfig fields for train.optimizer, its Muon group and the LR schedule."""
    t = recipe.train
    out: dict[str, object] = {"optimizer": t.optimizer, "lr": t.lr, "weight_decay": t.weight_decay,
                              "scheduler_type": t.scheduler, "scheduler_warmup_ratio": t.warmup_ratio}
    if t.optimizer == "muon":
        m = t.muon_settings()
        # TrainerConfig's own default Muon lr is 0.02 whatever --lr says; speculators' CLI passes --lr
        out.update(muon_lr=m.lr or t.lr, muon_momentum=m.momentum, muon_weight_decay=m.weight_decay,
                   muon_ns_steps=m.ns_steps, muon_adjust_lr_fn=m.adjust_lr_fn)
    return out
