"""Conditional S3 writes (``If-None-Match: *`` to create, ``If-Match: <ETag>`` to replace) for the run-folder
lease: a writer whose ETag is no longer the object's gets HTTP 412 and learns it lost the lease. The project's S3
server (SeaweedFS, tests/local_services.py) honours both, as AWS S3 does."""
from __future__ import annotations

import threading

from compat_core.io import S3Uri
from pipelines.store.lease import PreconditionFailed


class S3ConditionalObjects:
    """``read`` / ``write`` / ``etag`` of single ``s3://bucket/key`` objects through boto3 with the settings and
    credentials of an :class:`cluster.storage.s3.S3Access` (the standard AWS chain)."""

    def __init__(self, access) -> None:
        self.access = access
        self._lock = threading.Lock()
        self._client = None

    def _s3(self):
        import boto3
        from botocore.config import Config

        with self._lock:
            if self._client is None:
                frozen = self.access._frozen()
                s = self.access.settings
                # a session of its own: boto3's default session caches the AWS config of its first use
                self._client = boto3.session.Session(profile_name=self.access.settings.profile).client(
                    "s3", endpoint_url=s.endpoint_url, region_name=s.region, aws_access_key_id=frozen.access_key,
                    aws_secret_access_key=frozen.secret_key, aws_session_token=frozen.token,
                    config=Config(s3={"addressing_style": s.addressing_style}, connect_timeout=s.connect_timeout_s,
                                  read_timeout=s.request_timeout_s, retries={"max_attempts": s.max_attempts},
                                  request_checksum_calculation="when_required"))
            return self._client

    def read(self, uri: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of the object, None when there is none."""
        from botocore.exceptions import ClientError

        location = S3Uri.parse(uri)
        try:
            response = self._s3().get_object(Bucket=location.bucket, Key=location.key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return response["Body"].read(), response["ETag"]

    def etag(self, uri: str) -> str | None:
        """The object's ETag now (None when it does not exist)."""
        from botocore.exceptions import ClientError

        location = S3Uri.parse(uri)
        try:
            return self._s3().head_object(Bucket=location.bucket, Key=location.key)["ETag"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def write(self, uri: str, data: bytes, *, if_match: str | None = None, create: bool = False) -> str:
        """Put ``data`` only when the object does not exist (``create``) or still has ETag ``if_match``; returns
        the new ETag; PreconditionFailed when the condition does not hold."""
        from botocore.exceptions import ClientError

        location = S3Uri.parse(uri)
        conditions = {"IfNoneMatch": "*"} if create else {"IfMatch": if_match} if if_match else {}
        try:
            return self._s3().put_object(Bucket=location.bucket, Key=location.key, Body=data, **conditions)["ETag"]
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code")
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{uri}: {code or status}") from None
            raise
