"""torchrun's rendezvous arguments: one node, or one pod of an Indexed train Job across nodes.

Across nodes (k8s/overlays/full-multinode) torchrun's c10d rendezvous keeps its state in a
TCPStore that one agent hosts and the others connect to. torch 2.13 decides who hosts it in
torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py `_create_tcp_store` (line 134):
the `is_host` option when given (line 137), else a guess from the endpoint's hostname
(utils.py `_matches_machine_hostname`, line 117), which is wrong for a pod whose headless-Service
name does not resolve yet. A client retries its connection (DNS failures included:
torch/csrc/distributed/c10d/socket.cpp `SocketConnectOp::tryConnect`) only for `read_timeout`
(line 148: 60 s by default; TCPStore.cpp then retries once), and the host waits for the other
nodes only `join_timeout` (dynamic_rendezvous.py `create_handler`, line 1425; `_DEFAULT_TIMEOUTS`,
line 144: 600 s).
Nothing starts a JobSet's pods together: one may wait for a node or a multi-GB image pull while
the other is up. So pod 0 (JOB_COMPLETION_INDEX, which the Job controller sets in every container
of an Indexed Job) always hosts the store, and both timeouts cover a node wait and an image pull.
"""

from __future__ import annotations

from collections.abc import Mapping

from eagle_jobs.errors import BadInput

# 30 minutes: a cluster autoscaler adding an 8-GPU node plus pulling the train image (~10 GB)
RDZV_TIMEOUT_S = 1800


def torchrun_rendezvous_args(nnodes: int, env: Mapping[str, str]) -> list[str]:
    """torchrun's rendezvous arguments for this process: --standalone on one node; across nodes
    c10d on EAGLE_JOBS_RDZV_ENDPOINT with the store on pod 0 (see the module docstring)."""
    if nnodes <= 1:
        return ["--standalone"]
    endpoint = env.get("EAGLE_JOBS_RDZV_ENDPOINT")
    index = env.get("JOB_COMPLETION_INDEX", "")
    if not endpoint:
        raise BadInput(f"train: {nnodes} nodes but EAGLE_JOBS_RDZV_ENDPOINT is not set: set it to pod 0's "
                       "<host>:<port> (k8s/overlays/full-multinode does)")
    if not index.isdigit():
        raise BadInput(f"train: {nnodes} nodes but JOB_COMPLETION_INDEX is {index!r}: run the train Job with "
                       "completionMode: Indexed (the Job controller sets it), or set it to this node's index")
    timeout = env.get("EAGLE_JOBS_RDZV_TIMEOUT_S") or str(RDZV_TIMEOUT_S)
    if not timeout.isdigit() or int(timeout) <= 0:
        raise BadInput(f"train: EAGLE_JOBS_RDZV_TIMEOUT_S is {timeout!r}: give whole seconds, e.g. {RDZV_TIMEOUT_S}")
    conf = f"is_host={'true' if int(index) == 0 else 'false'},read_timeout={timeout},join_timeout={timeout}"
    # --node-rank is left out: only the static backend reads it (torch/distributed/run.py config_from_args,
    # line 866: "node_rank is only used for static rdzv_backend. It will be ignored")
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf", conf]
