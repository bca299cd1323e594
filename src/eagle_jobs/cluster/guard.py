"""The run's guard: one small pod of the run that ends the run within minutes when a pod of it cannot start.

The kubelet waits, and never fails the pod, where a run cannot go on (kubernetes v1.33.0, docs/OPERATIONS.md#fail-fast):
- an image that cannot be pulled: the container waits in ErrImagePull / ImagePullBackOff, retried with a
  backoff of up to 5 minutes, for ever;
- a Secret or ConfigMap it names that does not exist: CreateContainerConfigError, retried at every sync;
- a restartable sidecar (the vLLM server) that exits: restarted in CrashLoopBackOff however often, even in a
  pod whose restartPolicy is Never;
- a pod on a node that stops answering: the taint manager deletes it (DisruptionTarget
  DeletionByTaintManager) once the node has been unreachable for its toleration, 300 s by default, but no
  kubelet confirms that it stopped, so it stays Terminating; with podReplacementPolicy: Failed the Job
  replaces it only once it is gone (see LOST_NODE_RULES), and the run's other pods wait.
Each holds GPUs until the stage's activeDeadlineSeconds, which is days. The guard (replicatedJob
`guard`, k8s/base/pipeline.yaml) reads its JobSet's pods every POLL_S. Once a container has waited for one
of those reasons for STUCK_AFTER_S, a sidecar has exited SIDECAR_EXITS times, or a pod has been terminating
for STUCK_AFTER_S past its grace period, it says which and why in
one line and exits ExitCode.STUCK: its podFailurePolicy fails its Job (FailJob) and the JobSet's
failurePolicy fails the run (BadInputFailsTheRun), which deletes every pod of it. `eagle-jobs status`
shows the line. It exits 0 once every other replicatedJob of the JobSet has succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle_jobs.cluster.api import pod_name, read_jobset, sidecars
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode

POLL_S = 30.0
# ErrImagePull's retries back off up to 5 minutes (kubelet's image backoff): two failed pulls at the cap
STUCK_AFTER_S = 600.0
SIDECAR_EXITS = 3  # a vLLM sidecar that exited this often will not come up by itself: bad arguments, no GPU, OOM
GUARD = "guard"  # the guard's replicatedJob and container

# waiting reasons that no retry by the kubelet clears: the image or the pod's configuration is wrong
# (kubernetes v1.33.0 pkg/kubelet/images/types.go, pkg/kubelet/kuberuntime/kuberuntime_container.go)
CANNOT_START = {
    "ErrImagePull": "the image cannot be pulled",
    "ImagePullBackOff": "the image cannot be pulled",
    "InvalidImageName": "the image name is invalid",
    "ErrImageNeverPull": "the image is not on the node and imagePullPolicy is Never",
    "CreateContainerConfigError": "a Secret or ConfigMap it names is missing",
    "CreateContainerError": "the container runtime cannot create it",
}


# Where a lost node's pod waits, at kubernetes v1.33.2 (openshift/microshift@b6226e7aea,
# deps/github.com/openshift/kubernetes/): the node is NotReady after node-monitor-grace-period, 50 s
# (pkg/controller/nodelifecycle/config/v1alpha1/defaults.go:46), and tainted unreachable:NoExecute
# (node_lifecycle_controller.go:70-71); every pod tolerates that taint for 300 s
# (plugin/pkg/admission/defaulttolerationseconds/admission.go:39) and is then deleted with a DisruptionTarget
# condition (pkg/controller/tainteviction/taint_eviction.go:129-139); a Job with podReplacementPolicy: Failed
# counts a deleted pod neither failed nor gone until its phase is Failed (pkg/controller/job/job_controller.go
# isPodFailed, 1977-1987) and creates no replacement while it terminates (1686-1690); PodGC deletes it only
# once the node is tainted node.kubernetes.io/out-of-service (pkg/controller/podgc/gc_controller.go:143-160).
LOST_NODE_RULES = "podReplacementPolicy: Failed, and PodGC deletes it only from an out-of-service node"


class Stuck(EagleJobsError):
    code = ExitCode.STUCK


def _lost_node(pod, since: float, now: float) -> str | None:
    """The line for a pod that has been terminating for STUCK_AFTER_S past its grace period: its kubelet
    would have ended it by then, so its node is gone or out of reach. None while it may still end."""
    grace = pod.metadata.deletion_grace_period_seconds
    if grace is None:  # the API server sets it on delete; else the pod's own, else Kubernetes' default 30 s
        grace = pod.spec.termination_grace_period_seconds if pod.spec else None
        grace = 30 if grace is None else grace
    if now - since < grace + STUCK_AFTER_S:
        return None
    node = (pod.spec.node_name if pod.spec else None) or "<node>"
    why = next((" (" + ": ".join(w for w in (c.reason, c.message) if w) + ")" for c in pod.status.conditions or []
                if c.type == "DisruptionTarget" and c.status == "True" and (c.reason or c.message)), "")
    return (f"pod {pod_name(pod)} on node {node}: terminating for {now - since:.0f} s, past its {grace} s "
            f"grace{why}, and no kubelet confirms it stopped: the node is lost or out of reach, and nothing "
            f"replaces the pod while it terminates ({LOST_NODE_RULES}). Once the node is off, run "
            f"`kubectl taint node {node} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`, delete the "
            "JobSet and submit again: the stages resume from what the store holds")


@dataclass
class StuckTracker:
    """Which containers have waited for a reason in CANNOT_START, and which pods have been terminating,
    since when (the guard's own clock: a container seen waiting once and then running again starts over)."""

    since: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def check(self, pods: list, now: float) -> str | None:
        """The first pod that cannot start, in one line; None while every pod may still start."""
        seen = set()
        for pod in pods:
            if pod.metadata is None or pod.status is None:
                continue
            if pod.metadata.deletion_timestamp is not None:
                if pod.status.phase in ("Succeeded", "Failed"):  # ended: the kubelet confirmed it
                    continue
                key = (pod_name(pod), "", "terminating")
                seen.add(key)
                lost = _lost_node(pod, self.since.setdefault(key, now), now)
                if lost:
                    return lost
                continue
            side = sidecars(pod)
            for cs in (pod.status.init_container_statuses or []) + (pod.status.container_statuses or []):
                w = cs.state.waiting if cs.state else None
                last = cs.last_state.terminated if cs.last_state else None
                if cs.name in side and (cs.restart_count or 0) >= SIDECAR_EXITS and last is not None:
                    said = (last.message or "").strip().splitlines()[-1:] or [last.reason or ""]
                    return (f"pod {pod_name(pod)}: sidecar {cs.name} exited {cs.restart_count} times, last with code "
                            f"{last.exit_code}: {said[0]}".rstrip(": ") +
                            " (eagle-jobs logs --stage <stage>; the stage's vllm.serve_args)")
                if w is None or w.reason not in CANNOT_START:
                    continue
                key = (pod_name(pod), cs.name, "image" if "Image" in w.reason else w.reason)
                seen.add(key)
                first = self.since.setdefault(key, now)
                if now - first >= STUCK_AFTER_S:
                    return (f"pod {pod_name(pod)}: container {cs.name} cannot start for {now - first:.0f} s: "
                            f"{CANNOT_START[w.reason]} ({w.reason}: {(w.message or '').strip()})")
        for key in set(self.since) - seen:  # running again, or gone: a later wait starts over
            del self.since[key]
        return None


def others_succeeded(jobset: dict) -> bool:
    """Every replicatedJob but the guard has as many succeeded Jobs as replicas (JobSet's
    status.replicatedJobsStatus[].succeeded: api/jobset/v1alpha2/jobset_types.go, v0.8.2 line 185, v0.12.0
    line 264), or the JobSet is already finished. The guard's exit 0 is what completes the run: a
    successPolicy without targetReplicatedJobs counts every replicatedJob (pkg/controllers/success_policy.go
    line 33, both versions); a finished JobSet deletes its Jobs still active, the guard's included
    (pkg/controllers/jobset_controller.go lines 163-164, both versions)."""
    status = jobset.get("status") or {}
    if any(c.get("type") in ("Completed", "Failed") and c.get("status") == "True"
           for c in status.get("conditions") or []):
        return True
    done = {r.get("name"): r.get("succeeded", 0) for r in status.get("replicatedJobsStatus") or []}
    return all(done.get(rj["name"], 0) >= rj.get("replicas", 1)
               for rj in jobset["spec"]["replicatedJobs"] if rj["name"] != GUARD)


def guard(api, namespace: str, jobset: str, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll until the run's other stages have succeeded (return) or a pod of it cannot start (raise Stuck)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    core = client.CoreV1Api(api)
    tracker = StuckTracker()
    print(f"guarding JobSet {jobset} in {namespace}: a container that cannot start for {STUCK_AFTER_S:.0f} s, "
          f"a sidecar that exits {SIDECAR_EXITS} times, or a pod still terminating {STUCK_AFTER_S:.0f} s past its "
          "grace period fails the run", flush=True)
    while True:
        try:
            if others_succeeded(read_jobset(api, namespace, jobset)):
                print("every stage succeeded", flush=True)
                return
            pods = core.list_namespaced_pod(namespace, label_selector=(
                f"jobset.sigs.k8s.io/jobset-name={jobset},jobset.sigs.k8s.io/replicatedjob-name!={GUARD}")).items
        except ApiException as e:
            if e.status in (401, 403):
                raise BadInput(f"the guard may not read JobSet {jobset} or its pods ({e.status} {e.reason}): apply "
                               "k8s/cluster-setup (ServiceAccount and Role eagle-jobs-guard)") from None
            print(f"API server answered {e.status} {e.reason}: trying again in {POLL_S:.0f} s", flush=True)
        except HTTPError as e:  # the API server restarting or out of reach for a while: not the run's fault
            print(f"API server unreachable ({type(e).__name__}): trying again in {POLL_S:.0f} s", flush=True)
        else:
            why = tracker.check(pods, clock())
            if why:
                raise Stuck(why)
        sleep(POLL_S)
