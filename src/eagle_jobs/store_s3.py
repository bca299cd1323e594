"""What the store does on S3 and not on a file system (eagle_jobs.store): the s3fs filesystem, which
errors are worth a retry and which need a person (with the hint the one line gives), and a large object's
upload as parallel multipart parts.

The transfer sizes and retries are the process's settings (EAGLE_JOBS_MULTIPART_BYTES, _PART_BYTES,
_STORE_RETRIES), read once at import: they size module constants.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import fsspec

from eagle_jobs.errors import StoreError
from eagle_jobs.settings import settings

_s = settings()
MULTIPART_THRESHOLD = _s.multipart_bytes
PART_BYTES = max(5 * 1024**2, _s.part_bytes)  # S3's smallest part but the last
PARALLEL_PARTS = 8
RETRIES = _s.store_retries

FATAL_CODES = {
    "NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
    "InvalidBucketName", "AuthorizationHeaderMalformed", "ExpiredToken", "InvalidToken",
}
HINTS = {
    "NoSuchBucket": "create the bucket or fix the store URI",
    "InvalidAccessKeyId": "check AWS_ACCESS_KEY_ID / the store Secret",
    "SignatureDoesNotMatch": "check AWS_SECRET_ACCESS_KEY / the store Secret",
    "AccessDenied": "grant this identity read/write on the bucket",
}
DEFAULT_HINT = "check the store URI, AWS_ENDPOINT_URL and credentials"


def s3_filesystem() -> Any:
    """s3fs at the standard AWS_* endpoint, region and credentials (or the pod's role, via botocore).

    No listings cache: s3fs would answer a read of a key another process wrote after this one listed its
    prefix from the stale listing (FileNotFoundError), and stages read what other pods commit while they run.
    """
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    client_kwargs = {k: v for k, v in {"endpoint_url": endpoint, "region_name": region}.items() if v}
    return fsspec.filesystem(
        "s3", client_kwargs=client_kwargs, skip_instance_cache=True, use_listings_cache=False,
        config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}},
    )


def error_code(exc: BaseException) -> str | None:
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            return resp.get("Error", {}).get("Code")
    return None


def is_transient(exc: BaseException) -> bool:
    code = error_code(exc)
    if code in FATAL_CODES:
        return False
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if code in {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "503", "500"}:
        return True
    return isinstance(exc, (ConnectionError, TimeoutError, OSError, asyncio.TimeoutError))


def fatal(uri: str, what: str, e: BaseException) -> StoreError:
    """The one line for an error no retry mends: what failed, S3's code, what to check."""
    code = error_code(e) or type(e).__name__
    return StoreError(f"store {uri}: {what} failed ({code}): {HINTS.get(code, DEFAULT_HINT)}")


def check_bucket(fs: Any, uri: str, bucket: str, retry: Callable[[str, Callable[[], Any]], Any]) -> None:
    """The bucket exists and this identity may use it, or one line saying which is not so."""
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except Exception as e:  # noqa: BLE001
        code = error_code(e)
        if code in {"404", "NoSuchBucket"} or isinstance(e, FileNotFoundError):
            raise StoreError(f"store {uri}: bucket '{bucket}' does not exist: "
                             "create it or fix the store URI") from None
        denied = {"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"}
        if code in denied or isinstance(e, PermissionError):
            raise StoreError(f"store {uri}: access to bucket '{bucket}' denied: "
                             "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (the store Secret)") from None
        if is_transient(e):
            retry("head_bucket", lambda: fs.call_s3("head_bucket", Bucket=bucket))
            return
        raise fatal(uri, "head_bucket", e) from None


def multipart_upload(fs: Any, path: str, data: bytes) -> None:
    """One object in PART_BYTES parts, PARALLEL_PARTS at a time; visible only once complete, aborted on failure."""
    from fsspec.asyn import sync

    bucket, _, key = path.partition("/")
    sync(fs.loop, _multipart_async, fs, bucket, key, data)


async def _multipart_async(fs: Any, bucket: str, key: str, data: bytes) -> None:
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    sem = asyncio.Semaphore(PARALLEL_PARTS)

    async def part(n: int, start: int) -> dict:
        async with sem:
            body = data[start : start + PART_BYTES]
            r = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                  Body=body)
            return {"PartNumber": n, "ETag": r["ETag"]}

    try:
        parts = await asyncio.gather(*(part(i + 1, off) for i, off in enumerate(range(0, len(data), PART_BYTES))))
        await fs._call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
        )
    except BaseException:
        await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
