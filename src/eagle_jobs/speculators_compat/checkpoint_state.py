"""Adaptation 5 of eagle_jobs.speculators_compat: speculators' torch-pickled optimizer and scheduler state
as safetensors + a JSON tree (docs/FORMAT.md "train"), so nothing read back from a bucket is unpickled."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def state_to_safe(obj) -> tuple[dict[str, torch.Tensor], object]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            k = f"t{len(tensors)}"
            tensors[k] = x.detach().cpu().contiguous()
            return {"__tensor__": k}
        if isinstance(x, dict):
            return {"__dict__": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"__list__": [walk(v) for v in x], "tuple": isinstance(x, tuple)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot store {type(x).__name__} in checkpoint state")

    return tensors, walk(obj)


def state_from_safe(tensors: dict[str, torch.Tensor], tree):
    def walk(x):
        if isinstance(x, dict):
            if "__tensor__" in x:
                return tensors[x["__tensor__"]]
            if "__dict__" in x:
                return {walk(k): walk(v) for k, v in x["__dict__"]}
            if "__list__" in x:
                vals = [walk(v) for v in x["__list__"]]
                return tuple(vals) if x.get("tuple") else vals
        return x

    return walk(tree)


def export_checkpoint_dir(d: Path) -> dict[str, bytes]:
    """The objects a local speculators checkpoint directory becomes in the store."""
    from safetensors.torch import save

    out: dict[str, bytes] = {}
    for f in sorted(d.iterdir()):
        if f.is_symlink() or not f.is_file():
            continue
        if f.suffix == ".pt":  # written by speculators itself, in this process
            tensors, tree = state_to_safe(torch.load(f, weights_only=True, map_location="cpu"))
            out[f.stem + ".state.safetensors"] = save(tensors)
            out[f.stem + ".state.json"] = json.dumps(tree).encode()
        elif f.suffix in (".json", ".safetensors", ".txt", ".yaml"):
            out[f.name] = f.read_bytes()
        # config.py (auto_map code) is never copied: code from a bucket is not run
    return out


def import_checkpoint_dir(objects: dict[str, bytes], d: Path) -> None:
    """Rebuild a local speculators checkpoint directory from store objects (no unpickling)."""
    from safetensors.torch import load

    d.mkdir(parents=True, exist_ok=True)
    for name, data in objects.items():
        if name.endswith(".state.json"):
            stem = name.removesuffix(".state.json")
            tensors = load(objects[stem + ".state.safetensors"])
            torch.save(state_from_safe(tensors, json.loads(data)), d / f"{stem}.pt")
        elif not name.endswith(".state.safetensors"):
            (d / name).write_bytes(data)
