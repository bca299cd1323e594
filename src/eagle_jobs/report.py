"""The evaluation report: report.json for machines, report.md + PNG plots for people."""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.typing import ColorType

    from eagle_jobs.records import EvalReport, SpeedTable


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
    speed_png = _speedup_png(report)
    if speed_png is not None:
        files["speedup.png"] = speed_png
    files["report.md"] = _markdown(report, with_speedup_plot=speed_png is not None).encode()
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
    sel = (report.get("train") or {}).get("selection") or {}
    per_epoch = {int(e): v for e, v in (sel.get("per_epoch") or {}).items()}
    if per_epoch:
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


def _markdown(report: EvalReport, with_speedup_plot: bool) -> str:
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
        *_speedup_table(report),
        *_engine_table(report),
        *(["![speedup against concurrency](speedup.png)", ""] if with_speedup_plot else []),
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
    """Output tokens per second with the draft over without it, per set and concurrency, with TTFT."""
    sets = _measured_speed(report)
    if not sets:
        return ["## Speedup", "", f"{report.get('speedup_note') or 'not measured'}", ""]
    how = (f"{report['speedup_note']}; at most {next(iter(sets.values()))['max_tokens']} tokens per request; "
           f"{report['speedup_wall_s']:.0f} s of this evaluation, server start included.")
    head = ("| set | concurrency | requests | tokens/s with draft | tokens/s without | speedup | "
            "TTFT with (mean / p50) | TTFT without (mean / p50) |")
    rows = ["## Speedup", "", how, "", head, "|---|---|---|---|---|---|---|---|"]
    for name, sp in sets.items():
        for lv in sp["levels"]:
            w, wo = lv["with_draft"], lv["without_draft"]
            rows.append(f"| {name} | {lv['concurrency']} | {lv['requests']} | {w['output_tokens_per_s']:.1f} | "
                        f"{wo['output_tokens_per_s']:.1f} | **{lv['speedup']:.2f}x** | "
                        f"{w['ttft_s_mean']:.3f} / {w['ttft_s_p50']:.3f} s | "
                        f"{wo['ttft_s_mean']:.3f} / {wo['ttft_s_p50']:.3f} s |")
    above = [f"{name} at concurrency {lv['concurrency']}" for name, sp in sets.items() for lv in sp["levels"]
             if lv["speedup"] > report["prompt_sets"][name]["acceptance_length"]]
    if above:  # each verifier forward yields τ tokens on average and costs at least a plain decode step
        rows += ["", f"A speedup above the set's τ ({', '.join(above)}) is more than speculation can give: the "
                 "machine's load changed between the two servers' passes. Rerun on an otherwise idle machine, or "
                 "time more requests (evaluate.speedup_requests)."]
    if report.get("min_speedup") is not None:
        rows += ["", f"promote requires a speedup of at least {report['min_speedup']:.2f}x "
                     "at concurrency 1 on every set."]
    return [*rows, ""]


def _speedup_png(report: EvalReport) -> bytes | None:
    """Speedup against concurrency, one line per prompt set; 1.0 is where the draft stops paying."""
    sets = _measured_speed(report)
    if not sets:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    levels = sorted({lv["concurrency"] for sp in sets.values() for lv in sp["levels"]})
    points: dict[int, list[tuple[float, ColorType]]] = {}
    for name, sp in sets.items():
        xs, ys = [lv["concurrency"] for lv in sp["levels"]], [lv["speedup"] for lv in sp["levels"]]
        line, = ax.plot(xs, ys, marker="o", label=name)
        for x, y in zip(xs, ys):
            points.setdefault(x, []).append((y, line.get_color()))
    for x, pts in points.items():  # at each level the highest label above its point, the others below, stacked
        for rank, (y, color) in enumerate(sorted(pts, reverse=True)):
            ax.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(0, 7 if rank == 0 else -13 * rank),
                        ha="center", fontsize=8, color=color)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="no draft (1.0)")
    top = max(1.2, max(lv["speedup"] for sp in sets.values() for lv in sp["levels"]) * 1.15)
    ax.set_xscale("log", base=2)
    ax.set_xlim(levels[0] / 1.5, levels[-1] * 1.5)
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set(title="speedup: output tokens/s with the draft over without", xlabel="concurrent requests",
           ylabel="speedup", ylim=(0, top))
    ax.legend(fontsize=8)
    return _png(fig)
