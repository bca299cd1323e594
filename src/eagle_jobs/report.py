"""The evaluation report: report.json for machines, report.md + PNG plots for people."""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    from eagle_jobs.records import EvalReport, PositionBucket, ServingRange, SpeedTable


def _png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed (pyplot keeps every open one)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _series(metrics: list[dict], key_prefix: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        if "train" not in m:
            continue
        for k, v in m["train"].items():
            if k.startswith(key_prefix) and isinstance(v, (int, float)):
                out.setdefault(k, []).append((m.get("global_step", 0), float(v)))
    return out


def ema(values: list[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average: per-step training values are too noisy to read a trend from."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def _epoch_end_steps(metrics: list[dict]) -> dict[int, int]:
    """The last training step of each epoch: where its validation is drawn on a step axis."""
    ends: dict[int, int] = {}
    for m in metrics:
        if "train" in m and "epoch" in m:
            ends[int(m["epoch"])] = max(ends.get(int(m["epoch"]), 0), int(m.get("global_step", 0)))
    return ends


def _validation(metrics: list[dict], train_key: str) -> list[tuple[int, float]]:
    """(epoch, value) of a training series' held-out counterpart (loss -> loss_epoch, ...)."""
    out = []
    for m in metrics:
        v = (m.get("val") or {}).get(f"{train_key}_epoch")
        if isinstance(v, (int, float)) and "epoch" in m:
            out.append((int(m["epoch"]), float(v)))
    return out


def write_report(report: EvalReport, metrics: list[dict]) -> dict[str, bytes]:
    """report.md, report.json and the PNGs report.md shows, by file name."""
    import matplotlib

    matplotlib.use("Agg")
    files = {"training.png": _training_png(report, metrics), "acceptance.png": _acceptance_png(report),
             "tau.png": _tau_png(report)}
    for name, png in (("speedup.png", _speedup_png(report)), ("position.png", _position_png(report))):
        if png is not None:
            files[name] = png
    files["report.md"] = _markdown(report, plots=set(files)).encode()
    files["report.json"] = json.dumps({k: v for k, v in report.items() if k != "outputs"}, indent=1).encode()
    return files


def _training_png(report: EvalReport, metrics: list[dict]) -> bytes:
    """Training loss and per-step accuracy over steps (raw values faint, their EMA on top, each epoch's
    held-out validation as points at its last step); the held-out tau estimate per epoch, exported starred."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.6))
    ends = _epoch_end_steps(metrics)
    for ax, prefix, skip in ((ax1, "loss", {"loss_sum", "loss_total"}), (ax2, "full_acc", set())):
        for i, (name, pts) in enumerate(sorted(_series(metrics, prefix).items())):
            if name in skip:
                continue
            color = f"C{i % 10}"
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, color=color, alpha=0.2, lw=0.8)
            ax.plot(xs, ema(ys), color=color, lw=1.6, label=name)
            val = _validation(metrics, name)
            if val:
                ax.plot([ends.get(e, 0) for e, _ in val], [v for _, v in val], "o", color=color, ms=5,
                        markeredgecolor="black", markeredgewidth=0.5)
    ax1.set_title("training loss\n(EMA over faint raw steps; dots: held-out, per epoch)", fontsize=9)
    ax1.set(xlabel="step")
    ax1.legend(fontsize=7)
    ax2.set_title("accuracy per draft step, teacher forced\n(EMA; dots: held-out, per epoch)", fontsize=9)
    ax2.set(xlabel="step", ylim=(0, 1))
    ax2.legend(fontsize=7)
    summary = report.get("train")
    sel = summary.get("selection") if summary else None
    per_epoch = {int(e): v for e, v in (sel.get("per_epoch") or {}).items()} if sel else {}
    if sel and per_epoch:
        ax3.plot(list(per_epoch), list(per_epoch.values()), marker="o")
        ax3.plot([sel["epoch"]], [per_epoch[sel["epoch"]]], marker="*", markersize=14, color="tab:red",
                 label=f"exported: epoch {sel['epoch']}")
        ax3.legend(fontsize=7)
        for ax in (ax1, ax2):  # where the exported epoch ends on the step axes
            if sel["epoch"] in ends:
                ax.axvline(ends[sel["epoch"]], color="tab:red", lw=0.8, ls="--")
    ax3.set_title("held-out tau estimate per epoch\n(red: the exported epoch)", fontsize=9)
    ax3.set(xlabel="epoch")
    return _png(fig)


def _acceptance_png(report: EvalReport) -> bytes:
    """Per-position acceptance, trained against untrained."""
    import matplotlib.pyplot as plt

    k = report["num_speculative_tokens"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = list(range(1, k + 1))
    ax.bar([x - 0.2 for x in xs], report["per_position_acceptance"], width=0.4, label="trained draft")
    if base_per := report.get("baseline_per_position_acceptance"):
        ax.bar([x + 0.2 for x in xs], base_per, width=0.4, label="untrained draft")
    ax.set(title="acceptance by draft position", xlabel="position", ylabel="rate", ylim=(0, 1), xticks=xs)
    ax.legend(fontsize=8)
    return _png(fig)


def _tau_png(report: EvalReport) -> bytes:
    """Tau against the untrained baseline and the teacher-forced estimate."""
    import matplotlib.pyplot as plt

    k = report["num_speculative_tokens"]
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    names, vals = ["trained"], [report["acceptance_length"]]
    if (untrained := report.get("baseline_acceptance_length")) is not None:
        names.append("untrained")
        vals.append(untrained)
    if (estimate := report.get("teacher_forced_estimate")) is not None:
        names.append("teacher-forced\nestimate")
        vals.append(estimate)
    ax.bar(names, vals, color=["tab:blue", "tab:gray", "tab:orange"][: len(vals)])
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set(title=f"acceptance length tau (k={k})", ylim=(0, k + 1))
    for i, v in enumerate(vals):
        ax.text(i, v + 0.05, f"{v:.2f}", ha="center")
    return _png(fig)


def _markdown(report: EvalReport, plots: set[str]) -> str:
    k = report["num_speculative_tokens"]
    base = report.get("baseline_acceptance_length")
    tf = report.get("teacher_forced_estimate")
    per = ", ".join(f"{p:.2f}" for p in report["per_position_acceptance"])
    md = [
        f"# EAGLE-3 draft evaluation: run `{report['run_id']}`", "",
        f"- verifier: `{report['verifier']}`", f"- draft: `{report['draft']}`",
        f"- prompts: {report['num_prompts']} ({report['prompts']}), {report['tokens_generated']} tokens generated, "
        f"{report['verifier_forwards']} verifier forwards, backend `{report['backend']}`", "",
        "| measure | value |", "|---|---|",
        f"| acceptance length tau (k={k}, greedy chain) | **{report['acceptance_length']:.3f}** |",
        f"| untrained draft, same loop | {base:.3f} |" if base is not None else "| untrained draft | not run |",
        (f"| teacher-forced estimate of the exported epoch (training metrics) | {tf:.3f} |" if tf is not None
         else "| teacher-forced estimate | n/a |"),
        f"| per-position acceptance | {per} |",
        *([f"| checkpoint | epoch {sel['epoch']} of {sel.get('last_epoch', sel['epoch']) + 1}: {sel['by']} |"]
          if (sel := (report.get("train") or {}).get("selection")) else []), "",
        "tau = tokens per verifier forward, bonus token included (vLLM's 1 + accepted/drafts).", "",
        *_per_set_table(report),
        *_position_table(report),
        *(["![tau by output position](position.png)", ""] if "position.png" in plots else []),
        *_speedup_table(report),
        *(["![speedup against concurrency](speedup.png)", ""] if "speedup.png" in plots else []),
        *_serving_section(report),
        *_engine_table(report),
        "![training](training.png)", "", "![acceptance by position](acceptance.png)", "", "![tau](tau.png)", "",
    ]
    return "\n".join(md)


def _engine_table(report: EvalReport) -> list[str]:
    """What measured every figure above: promote compares τ only under one engine key."""
    e = report.get("engine")
    if not e:
        return []
    rows = ["## Engine", "", "Every τ and speedup above was measured on this engine; `promote` compares only "
            f"figures under one engine key (`{e['key']}`).", "", "| | |", "|---|---|"]
    for field in ("engine", "version", "model_runner", "attention_backend", "spec_method"):
        rows.append(f"| {field.replace('_', ' ')} | {e[field]} |")
    rows.append("| speculative settings | " + ", ".join(f"{k} {v}" for k, v in e["spec_settings"].items()) + " |")
    rows.append("| sampling | " + ", ".join(f"{k} {v}" for k, v in e["sampling"].items()) + " |")
    return [*rows, ""]


def _per_set_table(report: EvalReport) -> list[str]:
    """τ on each prompt set on its own: drafts are compared set by set, as the field compares them."""
    sets = report.get("prompt_sets") or {}
    if not sets:
        return []
    rows = ["## τ per prompt set", "", "| set | source | prompts | τ | untrained τ | per-position acceptance |",
            "|---|---|---|---|---|---|"]
    for name, x in sets.items():
        base = x.get("baseline_acceptance_length")
        per = ", ".join(f"{p:.2f}" for p in x["per_position_acceptance"])
        rows.append(f"| {name} | `{x['source']}` | {x['num_prompts']} | **{x['acceptance_length']:.3f}** | "
                    f"{f'{base:.3f}' if base is not None else 'not run'} | {per} |")
    return [*rows, ""]


def _measured_speed(report: EvalReport) -> dict[str, SpeedTable]:
    """The prompt sets whose speed was measured, and their tables."""
    return {n: sp for n, x in (report.get("prompt_sets") or {}).items() if (sp := x.get("speedup"))}


def _speedup_table(report: EvalReport) -> list[str]:
    """Output tokens per second with the draft over without it, per set, draft length k and concurrency,
    with τ over the timed requests and TTFT."""
    sets = _measured_speed(report)
    if not sets:
        return ["## Speedup", "", f"{report.get('speedup_note') or 'not measured'}", ""]
    how = (f"{report['speedup_note']}; at most {next(iter(sets.values()))['max_tokens']} tokens per request; "
           f"{report['speedup_wall_s']:.0f} s of this evaluation, server starts included.")
    head = ("| set | k | concurrency | requests | τ of these requests | tokens/s with draft | tokens/s without | "
            "speedup | TTFT with (mean / p50) | TTFT without (mean / p50) |")
    rows = ["## Speedup", "", how, "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, sp in sets.items():
        for lv in sp["surface"]:
            w, wo, tau = lv["with_draft"], lv["without_draft"], lv["with_draft"].get("acceptance_length")
            rows.append(f"| {name} | {lv['k']} | {lv['concurrency']} | {lv['requests']} | "
                        f"{'-' if tau is None else f'{tau:.2f}'} | {w['output_tokens_per_s']:.1f} | "
                        f"{wo['output_tokens_per_s']:.1f} | **{lv['speedup']:.2f}x** | "
                        f"{w['ttft_s_mean']:.3f} / {w['ttft_s_p50']:.3f} s | "
                        f"{wo['ttft_s_mean']:.3f} / {wo['ttft_s_p50']:.3f} s |")
    # each verifier forward yields τ tokens on average and costs at least a plain decode step
    above = [f"{name} at k {lv['k']}, concurrency {lv['concurrency']}" for name, sp in sets.items()
             for lv in sp["surface"] if lv["speedup"] > (lv["with_draft"].get("acceptance_length")
                                                         or report["prompt_sets"][name]["acceptance_length"])]
    if above:
        rows += ["", f"A speedup above its τ ({', '.join(above)}) is more than speculation can give: the "
                 "machine's load changed between the two servers' passes. Rerun on an otherwise idle machine, or "
                 "time more requests (evaluate.speedup_requests)."]
    if report.get("min_speedup") is not None:
        rows += ["", f"promote requires a speedup of at least {report['min_speedup']:.2f}x "
                     f"at concurrency 1 and k = {report['num_speculative_tokens']} on every set."]
    return [*rows, ""]


def _position_table(report: EvalReport) -> list[str]:
    """τ by where in the answer its verify steps start: whether acceptance holds as answers grow."""
    sets = {n: x for n, x in (report.get("prompt_sets") or {}).items() if x.get("by_position")}
    if not sets:
        return []
    trained = report["trained_answer_tokens"]
    rows = ["## τ by output position", "",
            f"Verify steps grouped by the output token they start at, {report['position_bucket_tokens']} tokens a "
            f"bucket. The draft was trained on answers of at most {trained} tokens (sampling.max_new_tokens).", "",
            "| set | max new tokens | output tokens | verify steps | τ |", "|---|---|---|---|---|"]
    for name, x in sets.items():
        for b in x["by_position"] or []:
            rows.append(f"| {name} | {x['max_new_tokens']} | {b['start']}-{b['end'] - 1} | {b['verify_steps']} | "
                        f"{b['acceptance_length']:.3f} |")
    for name, x in sets.items():
        if line := _past_training(name, x["by_position"] or [], trained):
            rows += ["", line]
    return [*rows, ""]


def _past_training(name: str, buckets: list[PositionBucket], trained: int) -> str | None:
    """What the set shows past the training length: τ of the steps within it against those past it."""
    def tau(bs: list[PositionBucket]) -> tuple[float, int]:
        steps = sum(b["verify_steps"] for b in bs)
        return sum(b["acceptance_length"] * b["verify_steps"] for b in bs) / steps, steps

    within, past = [b for b in buckets if b["start"] < trained], [b for b in buckets if b["start"] >= trained]
    if not within or not past:
        return None
    (t_in, n_in), (t_past, n_past) = tau(within), tau(past)
    return (f"{name}: τ {t_in:.3f} over the {n_in} verify steps that start in the first {within[-1]['end']} output "
            f"tokens, {t_past:.3f} over the {n_past} from token {past[0]['start']} on, past the longest trained "
            f"answer ({t_past - t_in:+.3f}).")


def _k_text(k: int) -> str:
    return "no draft" if k == 0 else f"k = {k}"


def _range_text(r: ServingRange) -> str:
    if r["last"] is None:
        return f"{r['first']} and above"
    return str(r["first"]) if r["last"] == r["first"] else f"{r['first']}-{r['last']}"


def _serving_section(report: EvalReport) -> list[str]:
    """The config to deploy: the best k per concurrency range, where no draft pays, the serve line."""
    from eagle_jobs.deploy import serve_line

    advice = report.get("serving")
    if not advice:
        return []
    rows = ["## Serve this draft", "", advice["note"] + ".", ""]
    if advice["by_level"]:
        rows += ["| concurrency | fastest k | its speedup | serve with |", "|---|---|---|---|"]
        for lv in advice["by_level"]:
            rows.append(f"| {lv['concurrency']} | {lv['best_k']} | {lv['speedup']:.2f}x | {_k_text(lv['k'])} |")
        rows += ["", "Batch sizes and k: " + ", ".join(f"{_range_text(r)} → {_k_text(r['k'])}"
                                                       for r in advice["ranges"]) + ".", ""]
    what = ("The command evaluate measured, with this config" if advice["by_level"]
            else "evaluate's serve_args with the config τ was measured at")
    rows += [f"{what} (`promote` writes it with the promoted draft's directory in place of DRAFT_DIR):", "",
             "```", serve_line(advice), "```", ""]
    return rows


def _speedup_png(report: EvalReport) -> bytes | None:
    """The speedup surface: per prompt set, speedup against concurrency, one line per draft length k;
    1.0 is where the draft stops paying, and a star marks the k the report recommends at each level."""
    sets = _measured_speed(report)
    if not sets:
        return None
    import matplotlib.pyplot as plt

    advice = report.get("serving")
    chosen = {lv["concurrency"]: lv["k"] for lv in advice["by_level"]} if advice else {}
    fig, axes = plt.subplots(1, len(sets), figsize=(4.6 * len(sets), 3.6), squeeze=False)
    for ax, (name, sp) in zip(axes[0], sets.items()):
        levels = sorted({c["concurrency"] for c in sp["surface"]})
        for k in sorted({c["k"] for c in sp["surface"]}):
            cells = [c for c in sp["surface"] if c["k"] == k]
            xs, ys = [c["concurrency"] for c in cells], [c["speedup"] for c in cells]
            line, = ax.plot(xs, ys, marker="o", label=f"k={k}")
            for c in cells:
                if chosen.get(c["concurrency"]) == k:
                    ax.plot([c["concurrency"]], [c["speedup"]], marker="*", markersize=14, color=line.get_color())
                    ax.annotate(f"{c['speedup']:.2f}x", (c["concurrency"], c["speedup"]), textcoords="offset points",
                                xytext=(0, 8), ha="center", fontsize=8, color=line.get_color())
        ax.axhline(1.0, color="black", lw=0.8, ls="--", label="no draft (1.0)")
        top = max(1.2, max(c["speedup"] for c in sp["surface"]) * 1.15)
        ax.set_xscale("log", base=2)
        ax.set_xlim(levels[0] / 1.5, levels[-1] * 1.5)
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set(title=name, xlabel="concurrent requests", ylabel="speedup: tokens/s with the draft / without",
               ylim=(0, top))
        ax.legend(fontsize=7)
    return _png(fig)


def _position_png(report: EvalReport) -> bytes | None:
    """τ by output position per prompt set, with the longest answer the draft was trained on."""
    sets = {n: x["by_position"] for n, x in (report.get("prompt_sets") or {}).items() if x.get("by_position")}
    if not sets:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, buckets in sets.items():
        ax.plot([(b["start"] + b["end"]) / 2 for b in buckets or []], [b["acceptance_length"] for b in buckets or []],
                marker="o", label=name)
    ax.axvline(report["trained_answer_tokens"], color="tab:red", lw=0.8, ls="--", label="longest trained answer")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set(title="tau by output position", xlabel="output token (bucket middle)", ylabel="tau",
           ylim=(0, report["num_speculative_tokens"] + 1))
    ax.legend(fontsize=7)
    return _png(fig)
