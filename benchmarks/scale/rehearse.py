"""The scale rehearsal: every pod of k8s/overlays/full run as its stage's own code at a recipe's conversation
count, on moto's S3 server, with the model maths replaced (benchmarks/scale/pod.py says what is).

    .venv/bin/python benchmarks/scale/rehearse.py --recipe jobs/kimi-k2.5.yaml --conversations 600000 1000000

Real: the rows, capture shards, extraction shard plan, manifests, markers and listings at the recipe's
counts; the token count of every row is the recipe's, times --token-scale (rows hold fewer ids, so the
corpus fits this machine), and the states are zeros of a hidden size divided by --hidden-div. Shard and
window bytes are scaled by the same factor as the bytes per token, so the number of rows per shard, of
shards and of window shards is the recipe's. Extraction runs the first --steady-shards shards of each
worker: the start-up (index, plan, reuse indexes, resume) is at full count, the steady state is per shard.

For each pod it reports peak RSS (VmHWM) beside the container's memory limit (with the states of one shard
in flight at the real scale added: `est_peak`), seconds to the first heartbeat beside the startup probe,
the longest heartbeat gap beside the liveness probe, and S3 requests; beside them the plan's figures.
It writes rehearsal.json, rehearsal.md and rehearsal.png to --out and exits 1 when a pod would be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POD = Path(__file__).with_name("pod.py")
HEADROOM = 0.8  # a pod passes when its estimated peak is at most this share of its limit

WORDS = ("the of and to a in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her all she there would their we him been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "function return value error list string python code data model train server memory request").split()


def _quantity(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", q)
    assert m, q
    return int(m.group(1)) * units.get(m.group(2), 1)


def overlay_pods(overlay: str = "k8s/overlays/full") -> dict[str, dict]:
    """Each stage's worker container in the rendered overlay: memory limit, startup and liveness budgets."""
    import yaml

    out = subprocess.run(["kubectl", "kustomize", str(REPO / overlay)], capture_output=True, text=True, check=True)
    pods = {}
    for d in yaml.safe_load_all(out.stdout):
        if not d or d.get("kind") != "JobSet":
            continue
        for rj in d["spec"]["replicatedJobs"]:
            job = rj["template"]["spec"]
            workers = [c for c in job["template"]["spec"]["containers"] if c["name"] == "worker"]
            if not workers:  # the run's guard: it lists pods, nothing of the corpus
                continue
            (c,) = workers

            def budget(probe):
                if not probe:
                    return None
                age = float(probe["exec"]["command"][-1])
                return {"max_age_s": age, "window_s": probe["periodSeconds"] * probe["failureThreshold"]}

            pods[rj["name"]] = {"memory_limit": _quantity(c["resources"]["limits"]["memory"]),
                                "workers": job.get("completions") or 1,
                                "startup": budget(c.get("startupProbe")), "liveness": budget(c.get("livenessProbe"))}
    return pods


def write_prompts(path: Path, n: int, seed: int = 0) -> None:
    """n ShareGPT-format conversations, one or two user turns, prompts of lognormal length (median about
    600 characters, as chat prompt sets have), words of English text and code."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            chars = min(8000, int(rnd.lognormvariate(6.4, 0.9)))
            words, size = [], 0
            while size < chars:
                w = rnd.choice(WORDS)
                words.append(w)
                size += len(w) + 1
            turns = [{"from": "human", "value": " ".join(words) + f" ({i})"}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def write_verifier(path: Path, layers: int, hidden: int, vocab: int) -> None:
    """A DeepSeek-V3 config with the recipe's depth and a divided hidden size: what load_config reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "moe_intermediate_size": hidden,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": vocab, "max_position_embeddings": 8192,
        "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "torch_dtype": "bfloat16"}))


def rehearsal_recipe(recipe_path: Path, work: Path, n: int, token_scale: float, hidden_div: int, store_uri: str):
    """The recipe as the rehearsal runs it, and the factor its byte budgets were scaled by."""
    from eagle_jobs.draft import stored_layer_ids
    from eagle_jobs.hsformat import bytes_per_token, resolve_storage
    from eagle_jobs.plan import make_plan
    from eagle_jobs.recipe_file import load_recipe

    r = load_recipe(recipe_path)
    layers = len(stored_layer_ids(r.aux_layer_ids, r.verifier.num_layers))
    real_hidden = r.draft.hidden_size
    plan = make_plan(r.model_copy(update={"prompts": r.prompts.model_copy(update={"limit": n})}))
    storage = resolve_storage(r.extract.storage_dtype, plan["tokens"], layers, real_hidden, r.extract.fp8_above_bytes)
    hidden = real_hidden // hidden_div
    scale = token_scale * bytes_per_token(layers, hidden, storage) / bytes_per_token(layers, real_hidden, storage)
    write_verifier(work / "verifier", r.verifier.num_layers, hidden, 163840)
    upd = {
        # trust_remote_code stays as the recipe says, with the recipe's serve_args (no eagle-jobs process
        # runs the verifier's code: eagle_jobs/verifier.py); a local directory needs no pinned revision
        "verifier": r.verifier.model_copy(update={"model": str(work / "verifier"), "revision": None, "weights": None}),
        "prompts": r.prompts.model_copy(update={"source": str(work / "prompts.jsonl"), "limit": n}),
        "extract": r.extract.model_copy(update={"storage_dtype": storage,
                                                 "shard_bytes": max(1, int(r.extract.shard_bytes * scale))}),
        "draft": r.draft.model_copy(update={"hidden_size": hidden, "intermediate_size": 4 * hidden,
                                             "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": None}),
        "store": r.store.model_copy(update={"uri": store_uri, "window_bytes": max(1, int((r.store.window_bytes or 0)
                                                                                          * scale)) or None}),
    }
    return r.model_copy(update=upd), plan, scale, storage, layers


class Moto:
    """moto's S3 server as its own process; every request is a line of its log (counted per pod)."""

    def __init__(self, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)

    def requests(self) -> int:
        return sum(1 for ln in open(self.log, errors="replace") if '" 2' in ln or '" 3' in ln or '" 4' in ln)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def store_objects(endpoint: str, bucket: str, prefix: str) -> dict[str, tuple[int, int]]:
    """(objects, bytes) under each stage's directory of the run."""
    import boto3

    out: dict[str, list[int]] = {}
    for page in boto3.client("s3", endpoint_url=endpoint).get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            stage = o["Key"][len(prefix):].split("/", 1)[0]
            c = out.setdefault(stage, [0, 0])
            c[0] += 1
            c[1] += o["Size"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for ln in open(f"/proc/{pid}/status"):
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def run_pod(role: str, recipe_file: Path, run_id: str, work: Path, moto: Moto, env: dict, worker: int = 0,
            workers: int = 1) -> dict:
    """One pod as a process: its peak RSS, heartbeats and requests, sampled every 0.1 s."""
    hb = work / f"heartbeat-{role}-{worker}"
    hb.unlink(missing_ok=True)
    log = work / f"{role}-{worker}.log"
    before = moto.requests()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(POD), role, str(recipe_file), run_id, str(worker), str(workers)],
                            env={**os.environ, **env, "EAGLE_JOBS_HEARTBEAT": str(hb),
                                 "REHEARSAL_WORK": str(work / f"train-{worker}")},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    peak, series, beats, last_mtime = 0, [], [], None
    while proc.poll() is None:
        st = _status(proc.pid)
        peak = max(peak, st.get("VmHWM", 0))
        now = time.monotonic() - t0
        series.append((round(now, 2), st.get("VmRSS", 0)))
        try:
            m = hb.stat().st_mtime
            if m != last_mtime:
                beats.append(now)
                last_mtime = m
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"rehearsal: pod {role} {worker} failed (exit {proc.returncode}); its log: {log}\n"
                         + text[-3000:])
    result = json.loads(text.rsplit("REHEARSAL-RESULT ", 1)[1].splitlines()[0])
    points = [0.0, *beats, wall]
    return {"role": role, "worker": worker, "wall_s": round(wall, 1), "peak_rss": peak,
            "beats": [round(b, 1) for b in beats[:: max(1, len(beats) // 400)]],
            "first_beat_s": round(beats[0], 1) if beats else None,
            "max_gap_s": round(max(b - a for a, b in zip(points[1:], points[2:])), 1) if len(beats) > 1 else None,
            "requests": moto.requests() - before, "result": result, "rss_series": series[:: max(1, len(series) // 400)]}


def shard_in_flight(recipe, plan: dict, layers: int) -> int:
    """What an extraction worker holds of one shard at the real scale: the states of the shard it computes
    and of the one it packs (bf16, as vLLM's connector writes them: 2 B), and the packed blob."""
    from eagle_jobs.hsformat import bytes_per_token

    tokens = recipe.extract.shard_bytes // bytes_per_token(layers, recipe.draft.hidden_size, plan["storage"])
    return 2 * tokens * layers * recipe.draft.hidden_size * 2 + recipe.extract.shard_bytes


def rehearse(recipe_path: Path, n: int, out: Path, token_scale: float, hidden_div: int, steady: int) -> dict:
    import boto3

    from eagle_jobs.recipe_file import load_recipe

    work = out / f"work-{n}"
    work.mkdir(parents=True, exist_ok=True)
    moto = Moto(work / "moto.log")
    env = {"AWS_ACCESS_KEY_ID": "rehearsal", "AWS_SECRET_ACCESS_KEY": "rehearsal", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": moto.url, "REHEARSAL_TOKEN_SCALE": str(token_scale),
           "REHEARSAL_STEADY_SHARDS": str(steady), "EAGLE_JOBS_WORK_DIR": str(work / "train")}
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # for make_plan and boto3 here
    try:
        boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket="rehearsal")
        t0 = time.monotonic()
        write_prompts(work / "prompts.jsonl", n)
        recipe, plan, scale, storage, layers = rehearsal_recipe(recipe_path, work, n, token_scale, hidden_div,
                                                                "s3://rehearsal/runs")
        recipe_file = work / "recipe.json"
        recipe_file.write_text(json.dumps(recipe.model_dump(mode="json")))
        print(f"rehearsal {n:,}: prompts written ({time.monotonic() - t0:.0f} s); byte budgets x {scale:.2e}, "
              f"{storage} states", flush=True)
        pods_spec = overlay_pods()
        run_id, pods = recipe.store.run_id, []
        for w in range(pods_spec["capture"]["workers"]):
            pods.append(run_pod("capture", recipe_file, run_id, work, moto, env, w, pods_spec["capture"]["workers"]))
        for w in range(pods_spec["extract"]["workers"]):
            pods.append(run_pod("extract", recipe_file, run_id, work, moto, env, w, pods_spec["extract"]["workers"]))
        for role in ("train", "evaluate", "status"):
            pods.append(run_pod(role, recipe_file, run_id, work, moto, env))
            print(f"  {role}: {pods[-1]['wall_s']} s", flush=True)
        stored = store_objects(moto.url, "rehearsal", f"runs/{run_id}/")
    finally:
        moto.stop()
        os.environ.clear()
        os.environ.update(saved)
    real = load_recipe(recipe_path)
    in_flight = shard_in_flight(real, {"storage": storage}, layers)
    rows = []
    for p in pods:
        spec = pods_spec.get(p["role"] if p["role"] != "status" else "evaluate", {})
        est = p["peak_rss"] + (in_flight if p["role"] == "extract" else 0)
        limit = spec.get("memory_limit") if p["role"] != "status" else None
        startup, live = spec.get("startup"), spec.get("liveness")
        killed = []
        if limit and est > HEADROOM * limit:
            killed.append("memory")
        if startup and p["role"] != "status" and (p["first_beat_s"] is None or p["first_beat_s"] > startup["window_s"]):
            killed.append("startup probe")
        if live and p["role"] != "status" and p["max_gap_s"] and p["max_gap_s"] > live["max_age_s"]:
            killed.append("liveness probe")
        rows.append({**p, "est_peak": est, "memory_limit": limit, "startup_window_s": startup and startup["window_s"],
                     "liveness_max_age_s": live and live["max_age_s"], "killed_by": killed})
    planned_shards = sum(p["result"].get("shards", 0) for p in pods if p["role"] == "extract")
    objs = {k: stored.get(k, (0, 0)) for k in ("capture", "extract", "stream")}
    measured = {"capture": {"objects": objs["capture"][0], "bytes": objs["capture"][1]},
                "extract": {"objects": 2 * planned_shards + 2, "shards_committed": objs["extract"][0] // 2,
                            "bytes": objs["extract"][1]},
                "stream": {"objects": objs["stream"][0]}}
    return {"conversations": n, "token_scale": token_scale, "measured_objects": measured, "hidden_div": hidden_div,
            "byte_scale": scale, "steady_shards": steady, "storage": storage,
            "plan": {k: plan[k] for k in ("samples", "tokens", "tokens_per_sample") if k in plan}
            | {"stages": {s: {k: v for k, v in x.items() if k in ("objects", "time_s")} for s, x in
                          plan.get("stages", {}).items()}},
            "shard_in_flight_bytes": in_flight, "pods": rows}


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _cell(v) -> str:
    return "-" if v is None or v == "" else str(v)


def markdown(results: list[dict]) -> str:
    lines = []
    for r in results:
        p0 = r["plan"]
        lines += [f"### {r['conversations']:,} conversations",
                  f"Plan: {p0.get('samples', 0):,} samples, {p0.get('tokens', 0):,} tokens, {r['storage']} states; "
                  f"rows hold x{r['token_scale']:g} of their tokens, byte budgets x{r['byte_scale']:.2e}, "
                  f"extraction's first {r['steady_shards']} shards per worker.", "",
                  "| pod | wall s | peak RSS GiB | est. peak GiB | limit GiB | first beat s | startup s | "
                  "max gap s | liveness s | S3 requests | killed by |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in r["pods"]:
            cells = [f"{p['role']} {p['worker']}", p["wall_s"], gib(p["peak_rss"]), gib(p["est_peak"]),
                     gib(p["memory_limit"]), p["first_beat_s"], p["startup_window_s"], p["max_gap_s"],
                     p["liveness_max_age_s"], f"{p['requests']:,}", ", ".join(p["killed_by"]) or "none"]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        st, mo = p0.get("stages", {}), r.get("measured_objects", {})
        lines += ["", "| stage | plan: objects | measured | plan: time |", "|---|---|---|---|"]
        for stage, what in (("capture", "objects committed"), ("extract", "2 a shard the stage planned, + 2")):
            lines.append(f"| {stage} | {st.get(stage, {}).get('objects', 0):,} | "
                         f"{mo.get(stage, {}).get('objects', 0):,} ({what}) | "
                         f"{st.get(stage, {}).get('time_s', 0) / 86400:.1f} d |")
        markers = mo.get("stream", {}).get("objects", 0)
        lines.append(f"| stream markers | - | {markers:,} (consumed, after epoch 0) | - |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), squeeze=False)
    for k, r in enumerate(results):
        ax, gaps = axes[0][k], axes[1][k]
        for p in r["pods"]:
            label = f"{p['role']} {p['worker']}"
            ax.plot([t for t, _ in p["rss_series"]], [v / 2**30 for _, v in p["rss_series"]], label=label)
            beats = p.get("beats") or []
            if len(beats) > 1:  # how long each beat came after the one before it
                gaps.plot(beats[1:], [b - a for a, b in zip(beats, beats[1:])], ".", label=label)
        ax.set_title(f"{r['conversations']:,} conversations: RSS over each pod's run")
        ax.set_ylabel("RSS GiB")
        ax.legend(fontsize=7)
        gaps.set_title("heartbeat gaps (the liveness probe allows 1,800 s)")
        gaps.set_xlabel("s since the pod started")
        gaps.set_ylabel("s since the previous beat")
        gaps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "jobs/kimi-k2.5.yaml")
    ap.add_argument("--conversations", type=int, nargs="+", default=[600_000, 1_000_000])
    ap.add_argument("--token-scale", type=float, default=1 / 64)
    ap.add_argument("--hidden-div", type=int, default=112)
    ap.add_argument("--steady-shards", type=int, default=40)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/scale/out")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    results = [rehearse(a.recipe, n, a.out, a.token_scale, a.hidden_div, a.steady_shards) for n in a.conversations]
    (a.out / "rehearsal.json").write_text(json.dumps(results, indent=1))
    (a.out / "rehearsal.md").write_text(markdown(results))
    plot(results, a.out / "rehearsal.png")
    print(markdown(results))
    killed = [(r["conversations"], p["role"], p["worker"], p["killed_by"]) for r in results for p in r["pods"]
              if p["killed_by"]]
    for n, role, w, why in killed:
        print(f"rehearsal: at {n:,} conversations the {role} pod {w} would be killed: {', '.join(why)}",
              file=sys.stderr)
    return 1 if killed else 0


if __name__ == "__main__":
    sys.exit(main())
