"""The process's environment, read in one place: every `EAGLE_JOBS_*` variable a pod, CI or a user sets.

`settings()` reads the environment when called, not at import: a training rank, a test and the CLI each
set variables before the code that reads them runs. An empty variable counts as unset, as the shell's
`${VAR:-default}` does. The store's transfer sizes (store_s3.py) are read once at import, where they size
module constants.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EAGLE_JOBS_", env_ignore_empty=True, extra="ignore")

    store: str | None = Field(default=None, description="the store URI a recipe's store: references and runs resolve "
                              "under (k8s/base's eagle-jobs-run ConfigMap); --store wins")
    run_id: str | None = Field(default=None, description="the run id (the run's ConfigMap); --run-id wins")
    work_dir: Path | None = Field(default=None, description="local scratch: checkpoints, staged shards, server logs")
    cache: Path | None = Field(default=None, description="downloaded verifier files (default ~/.cache/eagle-jobs)")
    vllm_endpoint: str | None = Field(default=None, description="the pod's vLLM sidecar (components/vllm-sidecar)")
    vllm_plans: Path | None = Field(default=None, description="the plans the pod's prepare wrote, which its vLLM "
                                    "sidecar serves one at a time (eagle_jobs.vllm_switch)")
    nnodes: int | None = Field(default=None, description="training nodes (overlays/full-multinode)")
    image_digests: dict[str, str] = Field(default_factory=dict, description="the images submit pinned, as JSON")
    multipart_bytes: int = Field(default=64 * 1024**2, description="an S3 object above this is a multipart upload")
    part_bytes: int = Field(default=32 * 1024**2, description="a multipart upload's part (S3's minimum: 5 MiB)")
    store_retries: int = Field(default=6, description="retries of a store request that failed in a transient way")
    num_shards: int | None = Field(default=None, description="an Indexed Job's completion count, which Kubernetes "
                                   "sets no variable for (our manifests copy `completions`); --num-shards wins")
    progress_interval_s: float = Field(default=30.0, description="seconds between plain progress lines in a log")
    heartbeat: Path | None = Field(default=None, description="the file a stage touches while it makes progress "
                                   "(the pod's liveness probe reads its age; eagle_jobs.heartbeat)")
    git_commit: str | None = Field(default=None, description="the commit a draft is promoted from (else CI's "
                                   "GITHUB_SHA, else `git rev-parse HEAD`): lineage in the promoted serve.json")
    rank_exits: Path | None = Field(default=None, description="set by the training launcher: where each rank "
                                    "leaves the exit code of its named failure (train.launch)")

    def cache_root(self) -> Path:
        return self.cache or Path.home() / ".cache" / "eagle-jobs"

    def work_root(self) -> Path:
        return self.work_dir or Path.home() / ".cache" / "eagle-jobs" / "work"


def settings() -> Settings:
    """The environment as it is now."""
    return Settings()
