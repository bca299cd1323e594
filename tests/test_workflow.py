import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WF = REPO / ".github/workflows/retrain.yml"


def test_actionlint():
    exe = shutil.which("actionlint") or str(Path(sys.executable).with_name("actionlint"))
    r = subprocess.run([exe, str(WF)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_retrain_workflow_shape():
    wf = yaml.safe_load(WF.read_text())
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads `on` as true
    assert {"schedule", "workflow_dispatch", "push"} <= set(on)
    assert "jobs/**" in on["push"]["paths"]
    runs = [s.get("run", "") for s in wf["jobs"]["retrain"]["steps"]]
    order = [next(i for i, r in enumerate(runs) if f"eagle-jobs {c}" in r) for c in ("submit", "watch", "promote")]
    assert order == sorted(order)
    text = WF.read_text()
    assert "secrets.KUBECONFIG" in text and "secrets.AWS_SECRET_ACCESS_KEY" in text
    assert "AKIA" not in text  # no literal credentials


def test_submitter_role_is_least_privilege():
    docs = list(yaml.safe_load_all((REPO / "k8s/rbac/submitter.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "eagle-jobs"
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs[("jobset.x-k8s.io", "jobsets")] >= {"get", "watch", "patch", "create"}
    assert verbs[("batch", "jobs")] == {"get", "list", "watch"}
    assert verbs[("", "pods/log")] == {"get"}
    assert not any(r in ("secrets", "pods/exec", "*") for _g, r in verbs)
    assert not any("*" in v for v in verbs.values())
    assert not any(d["kind"].startswith("Cluster") for d in docs)


def test_submitter_rbac_validates():
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", "1.33.0", str(REPO / "k8s/rbac/submitter.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("passed") == 3, r.stdout + r.stderr
