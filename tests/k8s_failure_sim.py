"""A stand-in for the two controllers that decide what a failed pod does to a run (no cluster runs here).

Fed with the rendered JobSet and the pods that fail, it plays Kubernetes' Job controller and
JobSet's controller in the order their sources apply their rules, and says how the run ends. The
pods are Kubernetes API objects (status.containerStatuses, initContainerStatuses, conditions), so
tests can hand the same Jobs and pods to tests/fake_kube.py and read them back with eagle-jobs.

Kubernetes (github.com/kubernetes/kubernetes, pkg/controller/job):
- pod_failure_policy.go @95f08499 `matchPodFailurePolicy`: the rules in order, the first match
  wins; onExitCodes looks at containerStatuses, then initContainerStatuses
  (`matchOnExitCodes`), only terminated containers with a non-zero code, of the named container
  (`getMatchingContainerFromList`); onPodConditions by type and status. FailJob gives the message
  "Container %s for pod %s/%s failed with exit code %v matching %v rule at index %d"; Ignore is
  not counted; Count and no match are counted.
- indexed_job_utils.go @78fc8e44 `isIndexFailed`: FailIndex fails the index at once; otherwise a
  counted failure fails it when the pod's index-failure-count annotation (counted failures of
  that index before it, `getNewIndexFailureCounts`) is >= backoffLimitPerIndex.
- job_controller.go @6ae037f1 `syncJob`: a FailJob match first (reason PodFailurePolicy), then
  failed > backoffLimit (BackoffLimitExceeded), then activeDeadlineSeconds (DeadlineExceeded),
  then with backoffLimitPerIndex: failed indexes > maxFailedIndexes (MaxFailedIndexesExceeded),
  else every index failed or succeeded with one failed (FailedIndexes).
- pkg/apis/batch/v1/defaults.go `SetDefaults_Job`: backoffLimit defaults to 6, or to MaxInt32
  when backoffLimitPerIndex is set.

JobSet (github.com/kubernetes-sigs/jobset pkg/controllers/failure_policy.go; line numbers at
v0.8.2 / v0.12.0, the oldest and newest we support):
- `executeFailurePolicy` (44 / 49): no failurePolicy fails the JobSet (reason FailedJobs);
  otherwise the first rule that matches, or RestartJobSet when none does
  (`defaultFailurePolicyRuleAction`, 40 / 45).
- `findFirstFailedPolicyRuleAndJob` (82 / 87): rule by rule, in order; for each rule the
  earliest-failed Job it applies to. `ruleIsApplicable` (135 / 142): the Job's failure reason in
  onJobFailureReasons (or none listed), its message matching onJobFailureMessagePatterns (v0.12,
  Go regexp.MatchString: unanchored), its replicatedJob in targetReplicatedJobs (or none listed).
- FailJobSet (182 / 215): Failed, reason FailJobSetFailurePolicyAction. RestartJobSet (192 / 225):
  Failed with ReachedMaxRestarts once restartsCountTowardsMax >= maxRestarts, else every Job is
  recreated and the count goes up. RestartJobSetAndIgnoreMaxRestarts: recreated, not counted.
  RestartJob (v0.12, behind an alpha gate that is off) is not modelled: no render may use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_INT32 = 2**31 - 1
NS = "eagle-jobs"
DISRUPTED = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
JOB_MESSAGES = {"BackoffLimitExceeded": "Job has reached the specified backoff limit",
                "DeadlineExceeded": "Job was active longer than specified deadline",
                "MaxFailedIndexesExceeded": "Job has exceeded the specified maximal number of failed indexes",
                "FailedIndexes": "Job has failed indexes"}


def _status(name: str, code: int | None) -> dict:
    state = {"waiting": {"reason": "PodInitializing"}} if code is None else {"terminated": {
        "exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
    return {"name": name, "image": "x", "imageID": "", "ready": False, "restartCount": 0, "state": state}


def failed_pod(worker: int | None = None, prepare: int | None = None, disrupted: bool = False,
               guard: int | None = None) -> dict:
    """A failed pod's status: the worker's exit code, or prepare's (the worker then never ran), or the
    run's guard's (its one container), and whether it carries the DisruptionTarget condition (preempted,
    evicted, its node drained)."""
    init = [] if prepare is None else [_status("prepare", prepare)]
    main = [_status("guard", guard)] if guard is not None else [_status("worker", worker)]
    return {"phase": "Failed", "conditions": [DISRUPTED] if disrupted else [],
            "initContainerStatuses": init, "containerStatuses": main}


# -- Kubernetes: pod_failure_policy.go ----------------------------------------------------------
def _matching_container(statuses: list[dict], req: dict) -> dict | None:
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated")
        if term is None or (req.get("containerName") not in (None, cs["name"])) or term["exitCode"] == 0:
            continue
        hit = term["exitCode"] in req["values"]
        if hit == (req["operator"] == "In"):
            return cs
    return None


def match_pod_failure_policy(policy: dict | None, pod: dict, status: dict) -> tuple[str | None, bool, str | None]:
    """(FailJob message, counted, action) as matchPodFailurePolicy returns them; pod: its namespace and name."""
    if not policy:
        return None, True, None
    for index, rule in enumerate(policy["rules"]):
        action = rule["action"]
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            cs = (_matching_container(status.get("containerStatuses") or [], req)
                  or _matching_container(status.get("initContainerStatuses") or [], req))
            if cs is None:
                continue
            what = (f"Container {cs['name']} for pod {pod['namespace']}/{pod['name']} failed with exit code "
                    f"{cs['state']['terminated']['exitCode']}")
        else:
            cond = next((c for c in status.get("conditions") or [] for p in rule["onPodConditions"]
                         if c["type"] == p["type"] and c["status"] == p["status"]), None)
            if cond is None:
                continue
            what = f"Pod {pod['namespace']}/{pod['name']} has condition {cond['type']}"
        if action == "Ignore":
            return None, False, action
        if action == "FailJob":
            return f"{what} matching FailJob rule at index {index}", True, action
        if action in ("Count", "FailIndex"):
            return None, True, action
        # an unknown action: the Go switch has no case for it and goes on to the next rule
    return None, True, None


# -- Kubernetes: the Job controller -----------------------------------------------------------
@dataclass
class Job:
    jobset: str
    stage: str
    spec: dict
    failed: int = 0
    index_failures: dict[int, int] = field(default_factory=dict)
    failed_indexes: set[int] = field(default_factory=set)
    pods: list[dict] = field(default_factory=list)
    condition: tuple[str, str, str] | None = None  # (Complete|Failed, reason, message)

    @property
    def name(self) -> str:
        return f"{self.jobset}-{self.stage}-0"  # JobSet names its Jobs <jobset>-<replicatedJob>-<index>

    @property
    def labels(self) -> dict:
        return {"jobset.sigs.k8s.io/jobset-name": self.jobset, "jobset.sigs.k8s.io/replicatedjob-name": self.stage}

    def observe(self, index: int, status: dict) -> None:
        """One failed pod of `index`, as syncJob sees it; finishes the Job when a limit is reached."""
        completions, per_index = self.spec.get("completions", 1), self.spec.get("backoffLimitPerIndex")
        assert self.condition is None and index not in self.failed_indexes and index < completions
        pod = {"namespace": NS, "name": f"{self.name}-{index}-{len(self.pods):05x}", "index": index, "status": status}
        self.pods.append(pod)
        message, counted, action = match_pod_failure_policy(self.spec.get("podFailurePolicy"), pod, status)
        if action == "FailJob":
            self.condition = ("Failed", "PodFailurePolicy", message)
            return
        if counted:
            self.failed += 1
            before = self.index_failures.get(index, 0)
            if per_index is not None and (action == "FailIndex" or before >= per_index):
                self.failed_indexes.add(index)
            self.index_failures[index] = before + 1
        backoff = self.spec.get("backoffLimit", MAX_INT32 if per_index is not None else 6)
        if self.failed > backoff:
            self.condition = ("Failed", "BackoffLimitExceeded", JOB_MESSAGES["BackoffLimitExceeded"])
        elif per_index is not None and self.spec.get("maxFailedIndexes") is not None \
                and len(self.failed_indexes) > self.spec["maxFailedIndexes"]:
            self.condition = ("Failed", "MaxFailedIndexesExceeded", JOB_MESSAGES["MaxFailedIndexesExceeded"])

    def finish(self, deadline: bool) -> None:
        """The pods not scripted to fail succeed; or the deadline passes first."""
        if self.condition is not None:
            return
        if deadline:
            assert self.spec.get("activeDeadlineSeconds"), f"{self.stage} has no deadline to pass"
            self.condition = ("Failed", "DeadlineExceeded", JOB_MESSAGES["DeadlineExceeded"])
        elif self.failed_indexes:
            self.condition = ("Failed", "FailedIndexes", JOB_MESSAGES["FailedIndexes"])
        else:
            self.condition = ("Complete", "", "")

    def api_object(self, when: str) -> dict:
        kind, reason, message = self.condition
        done = [i for i in range(self.spec.get("completions", 1)) if i not in self.failed_indexes]
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": self.name, "namespace": NS, "labels": self.labels},
                "spec": {"template": {"spec": {"containers": [{"name": "worker", "image": "x"}]}}},
                "status": {"failed": self.failed, "succeeded": len(done) if kind == "Complete" else 0,
                           "failedIndexes": ",".join(map(str, sorted(self.failed_indexes))),
                           "conditions": [{"type": kind, "status": "True", "reason": reason, "message": message,
                                           "lastTransitionTime": when, "lastProbeTime": when}]}}

    def api_pods(self) -> list[dict]:
        """The failed pods as the API server lists them (JobSet's labels, the containers that ran)."""
        return [{"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": p["name"], "namespace": NS, "labels": self.labels},
                 "spec": {"initContainers": [{"name": c["name"], "image": "x"}
                                             for c in p["status"]["initContainerStatuses"]],
                          "containers": [{"name": "worker", "image": "x"}]},
                 "status": p["status"]} for p in self.pods]


# -- JobSet: failure_policy.go ------------------------------------------------------------------
def _applies(rule: dict, job: Job) -> bool:
    _, reason, message = job.condition
    return ((not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"])
            and (not rule.get("onJobFailureMessagePatterns")
                 or any(re.search(p, message) for p in rule["onJobFailureMessagePatterns"]))
            and (not rule.get("targetReplicatedJobs") or job.stage in rule["targetReplicatedJobs"]))


@dataclass
class Run:
    state: str  # Completed | Failed
    reason: str  # the JobSet's Failed reason, or ""
    restarts: int
    jobs: list[Job]  # the last attempt's Jobs, in stage order
    failed_job: Job | None = None


def run_jobset(js: dict, attempts: list[dict[str, dict]]) -> Run:
    """Play the JobSet through its attempts. attempts[n] scripts attempt n (0: before any restart):
    {stage: {"fail": [(index, failed_pod(...)), ...], "deadline": bool}}; unscripted pods succeed.
    Stages start one after another (dependsOn: Complete)."""
    fp, name = js["spec"].get("failurePolicy"), js["metadata"]["name"]
    counted = attempt = 0
    while True:
        script = attempts[attempt] if attempt < len(attempts) else {}
        jobs: list[Job] = []
        for rj in js["spec"]["replicatedJobs"]:
            job = Job(name, rj["name"], rj["template"]["spec"])
            jobs.append(job)
            for index, status in script.get(rj["name"], {}).get("fail", []):
                job.observe(index, status)
                if job.condition is not None:
                    break
            job.finish(script.get(rj["name"], {}).get("deadline", False))
            if job.condition[0] == "Failed":
                break
        failed = [j for j in jobs if j.condition[0] == "Failed"]
        if not failed:
            return Run("Completed", "", counted, jobs)
        if fp is None:
            return Run("Failed", "FailedJobs", counted, jobs, failed[0])
        rule = next((r for r in fp.get("rules") or [] if any(_applies(r, j) for j in failed)), None)
        job = next(j for j in failed if rule is None or _applies(rule, j))
        action = rule["action"] if rule else "RestartJobSet"
        if action == "FailJobSet":
            return Run("Failed", "FailJobSetFailurePolicyAction", counted, jobs, job)
        assert action in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"), f"{action}: not admitted (gated)"
        if action == "RestartJobSet":
            if counted >= fp.get("maxRestarts", 0):
                return Run("Failed", "ReachedMaxRestarts", counted, jobs, job)
            counted += 1
        attempt += 1
