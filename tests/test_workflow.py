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
    assert verbs[("jobset.x-k8s.io", "jobsets")] >= {"get", "watch", "patch", "create"}
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
