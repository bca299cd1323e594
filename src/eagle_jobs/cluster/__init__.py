"""Submitting and following a run on a cluster, with the kubernetes Python client, split by what an
operator does: render a run (render.py), apply it (apply.py), follow it (follow.py: status, watch)
explain a failure (explain.py: exit mapping, logs, events), and guard a run from inside it (guard.py: the pod
that fails a run whose pods cannot start); api.py is what they share."""

from eagle_jobs.cluster.api import MAX_JOBSET_NAME, WatchExit, api_client, jobset_name
from eagle_jobs.cluster.apply import submit
from eagle_jobs.cluster.explain import failure_exit, logs
from eagle_jobs.cluster.follow import HEARTBEAT_S, print_status, stage_states, store_progress, watch
from eagle_jobs.cluster.render import IMAGE_NAMES, name_suffix, pin_images, render

__all__ = ["HEARTBEAT_S", "IMAGE_NAMES", "MAX_JOBSET_NAME", "WatchExit", "api_client", "failure_exit", "jobset_name",
           "logs", "name_suffix", "pin_images", "print_status", "render", "stage_states", "store_progress", "submit",
           "watch"]
