import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WF = REPO / ".github/workflows/retrain.yml"


RECONCILE = REPO / ".github/workflows/reconcile.yml"


def test_actionlint():
    exe = shutil.which("actionlint") or str(Path(sys.executable).with_name("actionlint"))
    r = subprocess.run([exe, str(WF), str(RECONCILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _on(wf):
    return wf[True] if True in wf else wf["on"]  # YAML 1.1 reads `on` as true


def test_retrain_builds_from_the_commit_waits_for_approval_submits_and_returns():
    wf = yaml.safe_load(WF.read_text())
    on = _on(wf)
    assert {"schedule", "workflow_dispatch", "push"} <= set(on)
    assert "jobs/**" in on["push"]["paths"]
    images, submit = wf["jobs"]["images"], wf["jobs"]["submit"]
    built = {s["id"]: s["with"] for s in images["steps"] if s.get("uses", "").startswith("docker/build-push-action")}
    assert set(built) == {"capture", "extract", "train"}
    for name, w in built.items():
        assert w["file"] == f"images/{name}/Dockerfile" and w["tags"].endswith(":${{ github.sha }}") and w["push"]
        assert images["outputs"][name] == f"${{{{ steps.{name}.outputs.digest }}}}"
    assert submit["needs"] == "images" and submit["environment"] == "gpu-run"  # the approval gate before GPUs
    assert submit["permissions"]["id-token"] == "write"
    runs = "\n".join(s.get("run", "") for s in submit["steps"])
    for name in ("capture", "extract", "train"):
        assert f'--image "{name}=${name.upper()}_IMAGE"' in runs
        assert submit["env"][f"{name.upper()}_IMAGE"].endswith(f"@${{{{ needs.images.outputs.{name} }}}}")
    assert "eagle-jobs submit" in runs and "GITHUB_STEP_SUMMARY" in runs
    # it returns: nothing in it waits for a multi-day run or promotes
    assert not [ln for ln in runs.splitlines() if ln.strip().startswith(("eagle-jobs watch", "eagle-jobs promote"))]
    assert submit["timeout-minutes"] <= 60
    text = WF.read_text()
    assert "secrets.KUBECONFIG" in text and "secrets.AWS_SECRET_ACCESS_KEY" in text
    assert "AKIA" not in text  # no literal credentials


def test_reconcile_promotes_on_a_schedule_and_writes_the_job_summary():
    wf = yaml.safe_load(RECONCILE.read_text())
    assert "schedule" in _on(wf) and "workflow_dispatch" in _on(wf)
    runs = "\n".join(s.get("run", "") for s in wf["jobs"]["reconcile"]["steps"])
    assert "eagle-jobs reconcile" in runs and '--summary "$GITHUB_STEP_SUMMARY"' in runs and "--prefix ci-" in runs
    assert "AKIA" not in RECONCILE.read_text()


def test_submitter_role_is_least_privilege():
    docs = list(yaml.safe_load_all((REPO / "k8s/cluster-setup/submitter.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "eagle-jobs"
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    # list: submit runs one run of a recipe at a time
    assert verbs[("jobset.x-k8s.io", "jobsets")] >= {"get", "list", "watch", "patch", "create"}
    assert verbs[("batch", "jobs")] == {"get", "list", "watch"}
    assert verbs[("", "pods/log")] == {"get"}
    assert verbs[("", "events")] == {"list"}  # `logs` shows why a pod waits
    # submit applies only per-run objects: the shared ones of k8s/cluster-setup are read, never written
    assert verbs[("", "serviceaccounts")] == {"get"} and ("networking.k8s.io", "networkpolicies") not in verbs
    assert not any(r in ("secrets", "pods/exec", "*") for _g, r in verbs)
    assert not any("*" in v for v in verbs.values())
    assert not any(d["kind"].startswith("Cluster") for d in docs)


def test_submitter_rbac_validates():
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", "1.33.0", str(REPO / "k8s/cluster-setup/submitter.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("passed") == 3, r.stdout + r.stderr


def _cron_period_s(expr: str) -> float:
    """The shortest gap between two firings of a cron line (numbers and `*` fields), over two years."""
    import datetime as dt

    minute, hour, dom, month, dow = expr.split()

    def ok(field: str, v: int) -> bool:
        return field == "*" or v in {int(x) for x in field.split(",")}

    t, end, fired = dt.datetime(2027, 1, 1), dt.datetime(2029, 1, 1), []
    while t < end:
        if ok(hour, t.hour) and ok(dom, t.day) and ok(month, t.month) and ok(dow, (t.weekday() + 1) % 7):
            fired += [t.replace(minute=m) for m in range(60) if ok(minute, m)]
        t += dt.timedelta(hours=1)
    return min((b - a).total_seconds() for a, b in zip(fired, fired[1:]))


def test_the_schedule_does_not_fire_before_a_run_of_the_recipe_ends():
    """A scheduled retrain fires no sooner than the default recipe's planned wall time (capture, extraction,
    training, evaluation); submit refuses an overlapping run anyway (exit 11), and the workflow reports that
    instead of failing."""
    from eagle_jobs.plan import make_plan
    from eagle_jobs.recipe_file import load_recipe

    wf = yaml.safe_load(WF.read_text())
    (cron,) = [c["cron"] for c in _on(wf)["schedule"]]
    recipe = wf["env"]["RECIPE"].split("'")[1]
    plan = make_plan(load_recipe(REPO / recipe))
    assert _cron_period_s(cron) >= plan["total_time_s"], (cron, plan["total_time_s"] / 86400)
    runs = "\n".join(s.get("run", "") for s in wf["jobs"]["submit"]["steps"])
    assert '"$rc" = 11' in runs and "exit 0" in runs
    assert _cron_period_s("0 3 * * 1") == 7 * 86400  # the reader of cron lines itself
