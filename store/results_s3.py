"""`S3Results`: images as objects of any S3-compatible store (`s3://bucket/prefix`), through
boto3. Credentials, region and endpoint come from the standard AWS settings
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` for a
store other than AWS, `~/.aws/config`), never from the URL: the URL is written into job
records.

Each job's images are `prefix/{job id}/{run}-{i}.png` (`run`: the dispatch that made them).
Objects do not expire by themselves: the job record goes after RESULT_TTL, the objects stay
until the job is deleted or the bucket's lifecycle rule removes them (an expiration rule on the
prefix of a day more than RESULT_TTL). Readers get them through presigned URLs (the gateway
redirects there) or `get`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from sdfarm.native.videofile import MEDIA_TYPES, format_of
from sdfarm.store.results import SIGNED_URL_S


class S3Results:
    """A bucket (and a prefix in it) as a result store. Thread-safe: boto3 clients are."""

    inline = False

    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3

                self._client = boto3.session.Session().client("s3")
            return self._client

    def check(self) -> None:
        """The bucket answers with these credentials (a worker checks at start)."""
        self.client.head_bucket(Bucket=self.bucket)

    def _key(self, job_id: str, i: int, run: str) -> str:
        name = f"{job_id}/{run}-{i}.png" if run else f"{job_id}/{i}.png"
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, job_id: str, pngs: Sequence[bytes], run: str = "") -> list[str]:
        keys = []
        for i, data in enumerate(pngs):
            key = self._key(job_id, i, run)
            # A video job's file (an animated WebP or an MP4) comes after its frames
            # (sdfarm.native.video), so a presigned URL serves it with its own type.
            kind = MEDIA_TYPES.get(format_of(data) or "", "image/png")
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentType=kind)
            keys.append(key)
        return keys

    def get(self, job_id: str, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def delete(self, job_id: str, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
            )

    def signed_url(self, key: str, expires_s: int = SIGNED_URL_S) -> str | None:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
        )
