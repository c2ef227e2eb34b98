"""Object storage for the cluster layer: S3 settings from the standard AWS chain, one configured filesystem for all.

Configuration comes only from the standard AWS environment/config chain, resolved by boto3:

- endpoint: ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > the profile's ``services``/``endpoint_url`` entries
  (botocore's own precedence); none means AWS itself.
- region: ``AWS_REGION`` > ``AWS_DEFAULT_REGION`` / the profile's ``region`` > ``us-east-1``.
- addressing style: argument > the profile's ``s3 = addressing_style = ...`` > ``COMPAT_S3_ADDRESSING_STYLE`` >
  ``path`` for a custom endpoint (SeaweedFS, MinIO, Ceph need it) and ``virtual`` for AWS.
- credentials: boto3's credential chain (environment, shared credentials file, profile, SSO, container/instance
  metadata). They never come from a YAML file, are never logged, and are never pickled: an :class:`S3Access` sent to
  another process (a Ray actor) carries only its :class:`S3Settings` and resolves credentials again there.

:func:`configure_object_storage` installs the resulting ``pyarrow.fs`` filesystem into :mod:`compat_core.io`, so
RunStore, the shard readers and the dataset readers all use it. That filesystem translates the store's errors into
:class:`StorageUnavailableError` (endpoint unreachable), :class:`StorageAccessDeniedError` (bad credentials or
permissions) and :class:`BucketNotFoundError`, each naming the endpoint, bucket and key but never the secret.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

import botocore.credentials
import botocore.exceptions
import botocore.session
import pyarrow as pa
import pyarrow.fs as pafs

from cluster.storage.conditional_writes import S3ConditionalObjects
from cluster.storage.s3_reads import GuardedReads
from compat_core import io as cio
from pipelines.store.lease import set_conditional_objects

log = logging.getLogger(__name__)

ADDRESSING_STYLES = ("path", "virtual")
ADDRESSING_STYLE_ENV = "COMPAT_S3_ADDRESSING_STYLE"
REQUEST_TIMEOUT_ENV = "COMPAT_S3_REQUEST_TIMEOUT_S"
WAIT_NOTICE_S = 5.0  # a request slower than this says what it waits for
DEFAULT_REGION = "us-east-1"


class StorageError(OSError):
    """An object-store operation failed; the message names the endpoint, bucket and key."""


class StorageUnavailableError(StorageError, ConnectionError):
    """The object store's endpoint cannot be reached (connection refused, DNS failure, timeout)."""


class StorageAccessDeniedError(StorageError, PermissionError):
    """The store rejected the request: wrong secret, unknown access key, or no permission on the bucket/key."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket named in an ``s3://bucket/key`` URI does not exist at the endpoint."""


class StorageConfigError(ValueError):
    """The AWS environment/config chain does not yield a usable S3 configuration (names the missing piece)."""


@dataclass(frozen=True)
class S3Settings:
    """Everything about an S3 endpoint except the credentials: safe to log, pickle and record as run params.

    endpoint_url: ``scheme://host[:port]`` of an S3-compatible store, or None for AWS.
    connect_timeout_s / request_timeout_s: seconds (request: how long a try may stall without a byte;
    ``COMPAT_S3_REQUEST_TIMEOUT_S``). max_attempts: total tries per request (1 = no retry).
    """

    endpoint_url: str | None
    region: str = DEFAULT_REGION
    addressing_style: str = "path"
    profile: str | None = None
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.addressing_style not in ADDRESSING_STYLES:
            raise StorageConfigError(
                f"S3 addressing_style must be one of {ADDRESSING_STYLES}, got {self.addressing_style!r}"
            )
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise StorageConfigError(
                    f"S3 endpoint_url must look like http(s)://host[:port], got {self.endpoint_url!r}"
                )
            if parts.username or parts.password:
                # a URL with user:password would put a secret wherever the endpoint is shown
                raise StorageConfigError("S3 endpoint_url must not embed credentials (user:password@host)")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise StorageConfigError(f"S3 max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("connect_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise StorageConfigError(f"S3 {name} must be a number of seconds > 0, got {value!r}")

    @property
    def endpoint_display(self) -> str:
        """The endpoint as shown in error messages (the AWS regional endpoint when none is configured)."""
        return self.endpoint_url or f"https://s3.{self.region}.amazonaws.com"

    @classmethod
    def from_environment(cls, profile: str | None = None, endpoint_url: str | None = None,
                         region: str | None = None, addressing_style: str | None = None,
                         max_attempts: int | None = None) -> "S3Settings":
        """Resolve the settings through boto3's config chain; arguments (non-secret only) override it."""
        session = _boto_session(profile)
        return _settings_from_session(session, profile, endpoint_url, region, addressing_style, max_attempts)


def _boto_session(profile: str | None) -> botocore.session.Session:
    """A botocore session for ``profile`` (None: ``AWS_PROFILE`` or the default profile)."""
    core = botocore.session.Session(profile=profile)
    try:
        core.get_scoped_config()  # botocore checks the profile lazily; fail here with a clear message
    except botocore.exceptions.ProfileNotFound as error:
        raise StorageConfigError(f"AWS profile {profile!r} is not defined in the AWS config files: {error}") from None
    return core


def _settings_from_session(session: botocore.session.Session, profile: str | None, endpoint_url: str | None,
                           region: str | None, addressing_style: str | None,
                           max_attempts: int | None) -> S3Settings:
    # AWS_REGION is what current AWS SDKs read first; botocore's session only knows AWS_DEFAULT_REGION / the profile
    region = region or os.environ.get("AWS_REGION") or session.get_config_variable("region") or DEFAULT_REGION
    if endpoint_url is None:
        # boto3 applies AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / the profile's endpoint_url itself; asking a client
        # what it resolved keeps the precedence identical to every other AWS tool on the machine
        resolved = session.create_client("s3", region_name=region).meta.endpoint_url
        host = urlsplit(resolved).hostname or ""
        endpoint_url = None if host == "amazonaws.com" or host.endswith(".amazonaws.com") else resolved
    scoped = session.get_scoped_config()
    s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
    style = addressing_style or s3_section.get("addressing_style") or os.environ.get(ADDRESSING_STYLE_ENV)
    if style in (None, "", "auto"):
        style = "path" if endpoint_url else "virtual"
    if max_attempts is None:
        configured = os.environ.get("AWS_MAX_ATTEMPTS") or scoped.get("max_attempts")
        try:
            max_attempts = int(configured) if configured else 3
        except ValueError:
            raise StorageConfigError(f"AWS max_attempts must be an integer, got {configured!r}") from None
    request_timeout = os.environ.get(REQUEST_TIMEOUT_ENV)
    try:
        timeouts = {"request_timeout_s": float(request_timeout)} if request_timeout else {}
    except ValueError:
        raise StorageConfigError(f"{REQUEST_TIMEOUT_ENV} must be a number of seconds, got {request_timeout!r}") from None
    return S3Settings(endpoint_url=endpoint_url.rstrip("/") if endpoint_url else None, region=region,
                      addressing_style=style, profile=profile, max_attempts=max_attempts, **timeouts)


def mask_access_key(access_key: str | None) -> str:
    """An access key id shortened for messages (``AKIA...XYZ``); the secret key is never shown at all."""
    if not access_key:
        return "<none>"
    return access_key[:4] + "..." + access_key[-3:] if len(access_key) > 10 else access_key[:2] + "..."


class S3Access:
    """S3 settings plus credentials resolved through boto3's chain; builds the pyarrow filesystem the store reads and writes through.

    The repr shows the endpoint and a masked access key id only. Pickling keeps the settings and drops the
    credentials (the receiving process resolves its own), so secrets never reach an object store or a log.
    """

    def __init__(self, settings: S3Settings, credentials: botocore.credentials.Credentials | None) -> None:
        if not isinstance(settings, S3Settings):
            raise TypeError(f"settings must be S3Settings, got {type(settings).__name__}")
        if credentials is None:
            raise StorageConfigError(
                f"no AWS credentials found for S3 endpoint {settings.endpoint_display}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a shared credentials file, AWS_PROFILE, or run with an instance role"
            )
        self.settings = settings
        self._credentials = credentials
        self._lock = threading.Lock()
        self._filesystem: pafs.FileSystem | None = None
        self._filesystem_key: tuple | None = None

    @classmethod
    def from_environment(cls, profile: str | None = None, endpoint_url: str | None = None,
                         region: str | None = None, addressing_style: str | None = None,
                         max_attempts: int | None = None) -> "S3Access":
        """Settings and credentials from the standard AWS chain (see the module docstring for the precedence)."""
        session = _boto_session(profile)
        settings = _settings_from_session(session, profile, endpoint_url, region, addressing_style, max_attempts)
        return cls(settings, session.get_credentials())

    @classmethod
    def for_settings(cls, settings: S3Settings) -> "S3Access":
        """Credentials for known settings, resolved in this process (used when unpickling)."""
        return cls(settings, _boto_session(settings.profile).get_credentials())

    @property
    def access_key_hint(self) -> str:
        return mask_access_key(self._credentials.access_key)

    @property
    def credentials_source(self) -> str:
        """Where boto3 found the credentials (``env``, ``shared-credentials-file``, ``iam-role``, ...)."""
        return str(getattr(self._credentials, "method", "unknown"))

    def __repr__(self) -> str:
        s = self.settings
        return (f"S3Access(endpoint={s.endpoint_display!r}, region={s.region!r}, "
                f"addressing_style={s.addressing_style!r}, access_key={self.access_key_hint!r}, "
                f"secret_key='***', credentials_source={self.credentials_source!r})")

    __str__ = __repr__

    def __reduce__(self):
        return (S3Access.for_settings, (self.settings,))

    def _frozen(self) -> botocore.credentials.ReadOnlyCredentials:
        # refreshable credentials (instance role, SSO, assume-role) rotate; get_frozen_credentials refreshes them
        return self._credentials.get_frozen_credentials()

    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem for ``s3://`` paths (``bucket/key``), with translated errors.

        Cached; rebuilt when boto3 hands out rotated credentials. Local callers get the same object each time.
        """
        frozen = self._frozen()
        # per process: the AWS SDK's client (connections, its threads) does not survive a fork, and input workers
        # are forked from the stage's process after it has read from S3
        key = (frozen.access_key, frozen.secret_key, frozen.token, os.getpid())
        with self._lock:
            if self._filesystem is None or key != self._filesystem_key:
                s = self.settings
                options: dict = dict(
                    access_key=frozen.access_key, secret_key=frozen.secret_key, session_token=frozen.token,
                    region=s.region, connect_timeout=s.connect_timeout_s, request_timeout=s.request_timeout_s,
                    retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=s.max_attempts),
                    force_virtual_addressing=s.addressing_style == "virtual",
                )
                if s.endpoint_url:
                    parts = urlsplit(s.endpoint_url)
                    options.update(endpoint_override=parts.netloc, scheme=parts.scheme)
                elif s.addressing_style == "path":
                    # pyarrow addresses AWS virtually unless an endpoint is given; naming the regional endpoint
                    # is how path style is requested there
                    options.update(endpoint_override=f"s3.{s.region}.amazonaws.com", scheme="https")
                inner = pafs.S3FileSystem(**options)
                self._filesystem = pafs.PyFileSystem(_TranslatingS3Handler(inner, self))
                self._filesystem_key = key
            return self._filesystem


# ---- installing into compat_core.io ---------------------------------------------------------------------------------
_installed: S3Access | None = None


def configure_object_storage(access: S3Access | None = None) -> S3Access:
    """Install ``access`` (default: :meth:`S3Access.from_environment`) as the ``s3://`` filesystem of compat_core.io.

    Every ``compat_core.io.resolve("s3://...")`` after this (RunStore, shard and dataset readers) uses it.
    """
    global _installed
    access = access or S3Access.from_environment()
    access.filesystem()  # build now so a bad configuration fails here, not inside a stage
    cio.set_s3_filesystem_factory(access.filesystem)
    set_conditional_objects(S3ConditionalObjects(access))  # the run-folder lease's fenced writes
    _installed = access
    # settings are secret-free by construction; the repr masks the access key
    log.info("object storage configured: %r", access)
    return access


def installed_access() -> S3Access | None:
    """The :class:`S3Access` installed by :func:`configure_object_storage`, if any."""
    return _installed


@contextlib.contextmanager
def object_storage(access: S3Access | None = None) -> Iterator[S3Access]:
    """Install an S3 configuration for the duration of a ``with`` block, restoring the previous one afterwards."""
    global _installed
    previous_access = _installed
    access = access or S3Access.from_environment()
    access.filesystem()
    previous_factory = cio.set_s3_filesystem_factory(access.filesystem)
    previous_conditional = set_conditional_objects(S3ConditionalObjects(access))
    _installed = access
    try:
        yield access
    finally:
        cio.set_s3_filesystem_factory(previous_factory)
        set_conditional_objects(previous_conditional)
        _installed = previous_access


# ---- error translation ------------------------------------------------------------------------------------------
_UNREACHABLE_MARKERS = ("NETWORK_CONNECTION", "curlCode: 7", "Could not connect", "Couldn't connect",
                        "Connection refused", "Failed to connect", "Timeout was reached", "curlCode: 28",
                        "Could not resolve host")
_DENIED_MARKERS = ("ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID", "AccessDenied",
                   "SignatureDoesNotMatch", "InvalidAccessKeyId", "EXPIRED_TOKEN", "ExpiredToken",
                   "INVALID_CLIENT_TOKEN_ID", "HTTP response code: 403")
_NO_BUCKET_MARKERS = ("NO_SUCH_BUCKET", "NoSuchBucket")


def uses_object_storage(config, run_dir: str) -> bool:
    """True when the run directory or any data root is an s3:// URI."""
    return cio.is_s3(str(run_dir)) or cio.S3_SCHEME in json.dumps(config.model_dump(mode="json"), default=str)


def storage_error_for(message: str, *, endpoint: str, operation: str, location: cio.S3Uri,
                      access_key_hint: str) -> StorageError | None:
    """The translated error for a store failure message at ``location``, or None when the message matches no known
    failure."""
    where = location.where()
    if any(marker in message for marker in _UNREACHABLE_MARKERS):
        return StorageUnavailableError(
            f"S3 endpoint {endpoint} cannot be reached (connection refused or timed out) while {operation} "
            f"{where}; is the object store running? Committed objects are kept: retry once it is back. "
            f"[{message}]"
        )
    if any(marker in message for marker in _DENIED_MARKERS):
        return StorageAccessDeniedError(
            f"S3 endpoint {endpoint} denied {operation} {where} for access key {access_key_hint}: the secret key "
            f"is wrong, the key is unknown or expired, or it lacks permission. Check the AWS credential chain "
            f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, shared credentials file). [{message}]"
        )
    if any(marker in message for marker in _NO_BUCKET_MARKERS):
        return BucketNotFoundError(f"bucket {location.bucket!r} does not exist at S3 endpoint {endpoint} "
                                   f"(while {operation} {where})")
    return None


class _TranslatingS3Handler(pafs.FileSystemHandler):
    """Delegates to a pyarrow S3FileSystem and rewrites its errors to name endpoint, bucket and key.

    Streams returned by the inner filesystem are native pyarrow streams, so data transfer has no Python overhead.
    Writes first check (once per bucket) that the bucket exists: some S3-compatible stores create a missing bucket
    on the first PUT, which would turn a typo in a run URI into a silent new bucket.
    """

    def __init__(self, inner: pafs.S3FileSystem, access: S3Access) -> None:
        self.inner = inner
        self.access = access
        self._known_buckets: set[str] = set()

    def __reduce__(self):
        # the inner S3FileSystem pickles its secret key; rebuild from settings in the receiving process instead
        return (_handler_from_access, (self.access,))

    def _fail(self, error: OSError, operation: str, path: str) -> OSError:
        location = cio.S3Uri.from_path(path)
        settings = self.access.settings
        translated = storage_error_for(str(error), endpoint=settings.endpoint_display, operation=operation,
                                       location=location, access_key_hint=self.access.access_key_hint)
        if translated is not None:
            return translated
        if isinstance(error, FileNotFoundError) and location.bucket and not self._bucket_exists(location.bucket):
            return BucketNotFoundError(f"bucket {location.bucket!r} does not exist at S3 endpoint "
                                       f"{settings.endpoint_display} (while {operation} {location.where()})")
        if isinstance(error, FileNotFoundError):
            return FileNotFoundError(f"no object {location.where()} at S3 endpoint {settings.endpoint_display} "
                                     f"(while {operation})")
        return error

    def _bucket_exists(self, bucket: str) -> bool:
        if bucket in self._known_buckets:
            return True
        try:
            found = self.inner.get_file_info(bucket).type != pafs.FileType.NotFound
        except OSError as error:
            raise self._fail(error, "checking", bucket) from None
        if found:
            self._known_buckets.add(bucket)
        return found

    def _call(self, operation: str, path: str, function, *args):
        settings = self.access.settings
        notice = threading.Timer(WAIT_NOTICE_S, lambda: print(
            f"waiting for the S3 endpoint {settings.endpoint_display} ({operation} "
            f"{cio.S3Uri.from_path(path).where()}): no answer for {WAIT_NOTICE_S:g} s; giving up after "
            f"{settings.max_attempts} tries of {settings.request_timeout_s:g} s without progress", file=sys.stderr,
            flush=True))
        notice.daemon = True
        notice.start()
        try:
            return function(*args)
        except OSError as error:
            translated = self._fail(error, operation, path)
            if translated is error:
                raise
            raise translated from None
        finally:
            notice.cancel()

    def _check_bucket_for_write(self, path: str) -> None:
        location = cio.S3Uri.from_path(path)
        if location.bucket and not self._bucket_exists(location.bucket):
            raise BucketNotFoundError(
                f"bucket {location.bucket!r} does not exist at S3 endpoint {self.access.settings.endpoint_display} "
                f"(writing {location.where()}); create it first"
            )

    # ---- FileSystemHandler interface ----------------------------------------------------------------------------
    def get_type_name(self) -> str:
        return "compat-s3"

    def normalize_path(self, path):
        return self.inner.normalize_path(path)

    def equals(self, other) -> bool:
        return isinstance(other, _TranslatingS3Handler) and other.inner.equals(self.inner)

    def get_file_info(self, paths):
        return self._call("inspecting", paths[0] if paths else "", self.inner.get_file_info, paths)

    def get_file_info_selector(self, selector):
        return self._call("listing", selector.base_dir, self.inner.get_file_info, selector)

    def create_dir(self, path, recursive):
        self._call("creating a folder at", path, functools.partial(self.inner.create_dir, recursive=recursive), path)

    def delete_dir(self, path):
        self._call("deleting the folder at", path, self.inner.delete_dir, path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._call("deleting the contents of", path,
                   functools.partial(self.inner.delete_dir_contents, missing_dir_ok=missing_dir_ok), path)

    def delete_root_dir_contents(self):
        raise PermissionError("refusing to delete every bucket of the S3 endpoint "
                              f"{self.access.settings.endpoint_display}")

    def delete_file(self, path):
        self._call("deleting", path, self.inner.delete_file, path)

    def move(self, src, dest):
        self._call("moving", src, self.inner.move, src, dest)

    def copy_file(self, src, dest):
        self._call("copying", src, self.inner.copy_file, src, dest)

    def open_input_stream(self, path):
        stream = self._call("reading", path, self.inner.open_input_stream, path)
        return pa.PythonFile(GuardedReads(stream, self, path), mode="r")

    def open_input_file(self, path):
        # random access (Parquet footers and column chunks, ranged reads): every read is a request of its own
        handle = self._call("reading", path, self.inner.open_input_file, path)
        return pa.PythonFile(GuardedReads(handle, self, path, seekable=True), mode="r")

    def open_output_stream(self, path, metadata):
        self._check_bucket_for_write(path)
        return self._call("writing", path, functools.partial(self.inner.open_output_stream, compression=None, metadata=metadata), path)

    def open_append_stream(self, path, metadata):
        return self._call("appending to", path, functools.partial(self.inner.open_append_stream, compression=None, metadata=metadata), path)


def _handler_from_access(access: S3Access) -> _TranslatingS3Handler:
    return access.filesystem().handler
