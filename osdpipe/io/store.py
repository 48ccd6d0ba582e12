"""Where a path lives: on the local disk, or in object storage (``s3://bucket/key``, ``gs://bucket/key``).

A local path keeps the local code and is never handed to fsspec. An object-store URL opens an fsspec filesystem
(s3fs, gcsfs: the ``cloud`` extra) with the store's own way of finding its endpoint and credentials (for S3: the AWS
variables, ``AWS_ENDPOINT_URL`` for an S3-compatible store, ``~/.aws`` files, a profile, instance roles), and with
``runtime.storage_options[<scheme>]`` given to the filesystem as it is, over osdpipe's defaults (:data:`DEFAULTS`:
a connect timeout, so that an endpoint that does not answer fails instead of hanging).

Whatever fails is said in one line naming the URL and what to do (:func:`failure`): no such bucket, access denied,
no credentials, an endpoint that does not answer, a missing key. No credential reaches a message: :func:`redact`
takes signed query strings, key IDs and every secret the environment or the options hold out of any text, and
:func:`redacted_options` is what may be recorded of ``runtime.storage_options``.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import socket
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from osdpipe.io.errors import InputError
from osdpipe.io.output import OutputError

#: The schemes osdpipe reads and writes, each with the fsspec backend that serves it and the store's name.
SCHEMES = {"s3": ("s3fs", "S3"), "gs": ("gcsfs", "Google Cloud Storage")}
#: Other names for those stores (Hadoop's and Spark's s3a:// and s3n://, fsspec's gcs://): said with the name osdpipe
#: takes, so that the fix is in the error line.
SAME_STORE = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")
#: osdpipe's options under the user's: timeouts and few retries, so that an endpoint that does not answer fails the
#: first look at it (:func:`info`, :func:`first_look_s`) within 80 s, not after botocore's defaults (60 s a read, 5
#: attempts) times s3fs's 5 retries.
DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"connect_timeout": 10, "read_timeout": 30, "retries": {"max_attempts": 2}}},
    "gs": {},
}
#: Keys of ``storage_options`` (at any depth) whose values are credentials: never written, never said.
SECRET_KEYS = frozenset(
    {
        "key", "secret", "token", "password", "username", "client_secret", "refresh_token", "access_token",
        "private_key", "private_key_id", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
        "session_token", "credentials", "sas_token", "account_key", "connection_string",
    }
)  # fmt: skip
#: Environment variables that hold credentials: their values are taken out of any message.
SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
REDACTED = "***"
#: Query parameters of signed URLs (S3's SigV4 and SigV2, GCS's V4 signing, OAuth tokens).
_SIGNED = re.compile(
    r"((?:X-Amz-(?:Signature|Credential|Security-Token)|X-Goog-(?:Signature|Credential)|Signature|AWSAccessKeyId"
    r"|access_token|sig|token)=)[^&\s\"'<>]+",
    re.IGNORECASE,
)
_USERINFO = re.compile(r"(://)[^/@\s:]+:[^/@\s]+@")
_ACCESS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")


def is_url(path: object) -> bool:
    """Whether ``path`` is written as a URL (``scheme://...``), not a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def slash_short(path: object) -> str | None:
    """Why ``path`` is refused where it is a URL a slash short (``s3:/bucket/x``: a slash a shell, a config or a copy
    drops easily) of a store osdpipe serves, naming the URL meant; else ``None``. Taken as a local path, it would read
    a directory named ``s3:`` that is not there, or write the conversion into one beside the user."""
    match = _ONE_SLASH.match(path) if isinstance(path, str) else None
    if match is None or match.group(1).lower() not in SCHEMES:
        return None
    return f"{path!r} is a slash short of a URL; write {match.group(1) + '://' + path[match.end():]!r}"


def is_remote(path: object) -> bool:
    """Whether ``path`` names object storage osdpipe serves (``s3://``, ``gs://``)."""
    match = _URL.match(path) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() in SCHEMES


@dataclass(frozen=True)
class Location:
    """A place in object storage: ``scheme://bucket/key``, the key without leading or trailing ``/`` (``""``: the
    bucket's top)."""

    scheme: str
    bucket: str
    key: str = ""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key}" if self.key else "")

    @property
    def path(self) -> str:
        """The path fsspec's filesystem takes: ``bucket/key``."""
        return self.bucket + (f"/{self.key}" if self.key else "")

    @property
    def store(self) -> str:
        return SCHEMES[self.scheme][1]

    def child(self, *names: str) -> Location:
        """The location of ``names`` under this one (each may hold ``/``)."""
        parts = [self.key, *(n.strip("/") for n in names)]
        return Location(self.scheme, self.bucket, "/".join(p for p in parts if p))

    def __str__(self) -> str:
        return self.url


def parse(url: str, where: str = "path") -> Location:
    """``url`` as a :class:`Location`.

    Raises:
        ValueError: naming ``where`` (``input.path``), for a scheme osdpipe does not serve or a URL with no bucket.
    """
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"{where}={url!r} is not a URL; give s3://bucket/prefix, gs://bucket/prefix or a local path")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in SCHEMES:
        instead = written_instead(scheme, rest)
        fix = "" if instead is None else f"; write {instead}"
        raise ValueError(
            f"{where}={redact(url)!r}: osdpipe reads and writes s3:// and gs:// (and local paths), "
            f"not {scheme}://{redact(fix)}"
        )
    bucket, _, key = rest.partition("/")
    if not bucket or any(c in bucket for c in "?#@"):
        raise ValueError(f"{where}={redact(url)!r} names no bucket; give {scheme}://bucket/prefix")
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{where}={redact(url)!r}: a key holds no '.' or '..' segment; give the prefix itself")
    return Location(scheme, bucket, "/".join(parts))


def written_instead(scheme: str, rest: str) -> str | None:
    """What to write for ``<scheme>://<rest>``, a URL osdpipe does not take, where it names something osdpipe does:
    the same store under the name osdpipe takes (:data:`SAME_STORE`), or, for a ``file://`` URL of this machine, the
    local path. ``None``: nothing osdpipe reads."""
    if scheme in SAME_STORE:
        return f"{SAME_STORE[scheme]}://{rest}"
    host, _, path = rest.partition("/")
    if scheme == "file" and host in ("", "localhost"):
        return f"/{path}"
    return None


#: The smallest part of a multipart upload S3 takes (but the last); GCS's resumable chunks are multiples of 256 KiB.
MIN_PART = 5 << 20
#: What a part size is a multiple of: GCS's resumable uploads take chunks of 256 KiB multiples.
PART_QUANTUM = 256 << 10
#: The most parts one S3 multipart upload may have.
MAX_PARTS = 10_000


def upload_part_bytes(memory_budget: int | None) -> int | None:
    """The size of the parts a file is uploaded in under ``runtime.memory_budget``: an eighth of it (a file's upload
    holds two parts at most, and two uploads run at once: half the budget, beside the conversion's reads), a multiple
    of 256 KiB, at least :data:`MIN_PART`. ``None`` (no budget): the store client's own (s3fs: 50 MiB parts, ten at
    once)."""
    if memory_budget is None:
        return None
    return max(MIN_PART, memory_budget // 8 // PART_QUANTUM * PART_QUANTUM)


def parts_in_flight(part_bytes: int | None) -> int:
    """How many parts of one file go up at once, each a request of its own: a store serves them side by side, and
    one at a time would leave it idle while the client reads, hashes and signs the next. Two of
    :func:`upload_part_bytes` under ``runtime.memory_budget`` (what it counts for a file); four of the default 50
    MiB parts without one (s3fs sends ten of a file it uploads whole: osdpipe's rank files go up beside the
    conversion, which keeps the rest of the memory)."""
    return 4 if part_bytes is None else 2


def upload_options(scheme: str, part_bytes: int | None, largest: int) -> dict[str, Any]:
    """The keyword arguments of fsspec's ``put``/``put_file`` that upload in parts of ``part_bytes`` (``None``: the
    client's defaults), :func:`parts_in_flight` at a time, for files of at most ``largest`` bytes.

    s3fs reads a file smaller than two parts whole, else ``max_concurrency`` parts at a time (ten by default); gcsfs
    sends a resumable upload's chunks one by one. A part grows where S3's :data:`MAX_PARTS` would not hold the file.
    """
    if part_bytes is None:
        return {}
    fits = -(-largest // MAX_PARTS)
    part = max(part_bytes, -(-fits // PART_QUANTUM) * PART_QUANTUM)
    if scheme != "s3":
        return {"chunksize": part}
    return {"chunksize": part, "max_concurrency": parts_in_flight(part_bytes)}


def options_for(scheme: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The filesystem's keyword arguments: osdpipe's :data:`DEFAULTS` for ``scheme``, with
    ``storage_options[scheme]`` over them (nested dicts merged, the user's value winning)."""
    merged = copy.deepcopy(DEFAULTS.get(scheme, {}))
    _merge(merged, dict((storage_options or {}).get(scheme) or {}))
    return merged


def _merge(into: dict[str, Any], over: Mapping[str, Any]) -> None:
    for name, value in over.items():
        if isinstance(value, Mapping) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = copy.deepcopy(value)


def filesystem(
    location: Location, storage_options: Mapping[str, Any] | None = None, where: str = "path", probe: bool = False
):
    """A fresh fsspec filesystem for ``location``'s store (not fsspec's cached instance: credentials and options are
    read now). ``probe``: for a first look, which fails at the first error (s3fs's own retries off, and an endpoint
    the user set connected to first: :func:`_connect`), so that a store that does not answer is said within the
    options' timeouts.

    Raises:
        InputError or OutputError (:func:`error_type` of ``where``): the backend is not installed; with ``probe``, the
            endpoint the user set takes no connection.
    """
    module, store = SCHEMES[location.scheme]
    try:
        __import__(module)
    except ImportError:
        raise error_type(where)(
            f"{where}={location.url!r}: {store} needs {module}, which is not installed; "
            "pip install '.[cloud]' in osdpipe's checkout (the cloud extra)"
        ) from None
    import fsspec

    _quiet_clients()
    if probe:
        _connect(location, storage_options, where)
    fs = fsspec.filesystem(location.scheme, skip_instance_cache=True, **options_for(location.scheme, storage_options))
    if probe and hasattr(fs, "retries"):
        fs.retries = 1
    if location.scheme == "s3":
        _share_models(fs)
    return fs


#: The botocore loader of this process's S3 sessions: the service models, endpoint rules and partitions it parsed.
_models: Any = None


def _share_models(fs: Any) -> None:
    """Give a fresh s3fs filesystem the session s3fs would make itself (from the options it did not take: a
    ``profile``, say), but loading botocore's data through this process's one loader.

    A run opens an S3 client for each thing it does (the first look, the input's reads, the output's write test,
    its uploads, the commit), each on a fresh filesystem so that the credentials are read then; each new session
    parsed botocore's JSON models again (0.07 s a client on the benchmarks' VM, on the main thread, most of them
    before the first byte is read). What is shared is data from botocore's package, the same for every session; the
    credentials, the config and the endpoint stay each session's own. A session the user gave (``session=``) is
    left alone.
    """
    global _models
    if fs.session is not None:
        return
    from aiobotocore.session import AioSession

    session = AioSession(**fs.kwargs)
    if _models is None:
        _models = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _models)
    fs.session = session


#: The store clients' loggers. They say, on every run, where they found the credentials and the endpoint (botocore
#: at INFO: "Found credentials in environment variables."), and which ways to credentials failed before one worked
#: (google-auth at WARNING: "Authentication failed using Compute Engine authentication due to unavailable metadata
#: server."), and gcsfs logs each failed request with its traceback at ERROR ("_request out of retries on
#: exception", "non-retriable exception"); Hydra's console handler prints those lines among osdpipe's own.
CLIENT_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "google", "fsspec")


def _quiet_clients() -> None:
    """The store clients say nothing short of CRITICAL: every failure of theirs reaches osdpipe as an exception, which
    osdpipe says in its own line (:func:`failure`), without the client's traceback beside it."""
    for name in CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.CRITICAL:
            logger.setLevel(logging.CRITICAL)


#: Where each store's client takes an endpoint other than the store's own, in the order it looks: keys of its options
#: (``runtime.storage_options.<scheme>``), then environment variables (botocore: ``AWS_ENDPOINT_URL_S3`` over
#: ``AWS_ENDPOINT_URL``; gcsfs: ``STORAGE_EMULATOR_HOST``, a host with or without ``http://``).
ENDPOINT_SETTINGS: dict[str, tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]] = {
    "s3": ((("endpoint_url",), ("client_kwargs", "endpoint_url")), ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
    "gs": ((("endpoint_url",),), ("STORAGE_EMULATOR_HOST",)),
}
#: How long the connection to an endpoint the user set may take before the first look (:func:`_connect`), where the
#: options give no ``config_kwargs.connect_timeout`` (gs://): s3's default's.
CONNECT_S = 10.0


def endpoint_setting(location: Location, storage_options: Mapping[str, Any] | None = None) -> tuple[str | None, str]:
    """The endpoint the user set for ``location``'s store and what set it (``AWS_ENDPOINT_URL``,
    ``runtime.storage_options.s3.endpoint_url``, ``STORAGE_EMULATOR_HOST``); ``(None, <where one sets it>)`` where
    the client uses the store's own. For messages that name what to fix: each store reads its own variable."""
    options = options_for(location.scheme, storage_options)
    keys, variables = ENDPOINT_SETTINGS[location.scheme]
    for path in keys:
        node: Any = options
        for name in path:
            node = node.get(name) if isinstance(node, Mapping) else None
        if node:
            return str(node), ".".join(("runtime.storage_options", location.scheme, *path))
    for variable in variables:
        value = os.environ.get(variable)
        if value and not (variable == "STORAGE_EMULATOR_HOST" and value == "default"):  # gcsfs: the store's own
            return value, variable
    return None, ", ".join((*variables, ".".join(("runtime.storage_options", location.scheme, *keys[0]))))


def _connect(location: Location, storage_options: Mapping[str, Any] | None, where: str) -> None:
    """Open and close one TCP connection to the endpoint the user set (:func:`endpoint_setting`), before the first
    look; an endpoint that refuses it, or whose host does not resolve, is said now in one line (:func:`failure`).

    gcsfs retries a request that could not connect six times with growing pauses, 35 to 40 s, and no option of it
    says otherwise; a closed port must not cost that. The connection is bounded by the options' connect timeout
    (:data:`CONNECT_S` without one). Skipped where a proxy variable covers the endpoint (the client may reach it
    only through the proxy) and for the store's own endpoint.
    """
    url, _ = endpoint_setting(location, storage_options)
    if url is None:
        return
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number: the client says what it makes of it
        return
    proxies = urllib.request.getproxies()
    if host is None or (parts.scheme in proxies and not urllib.request.proxy_bypass(host)):
        return
    config = options_for(location.scheme, storage_options).get("config_kwargs")
    timeout = float((config or {}).get("connect_timeout", CONNECT_S)) if isinstance(config, Mapping) else CONNECT_S
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise failure(exc, location, where, storage_options) from None


def first_look_s(scheme: str, storage_options: Mapping[str, Any] | None = None) -> float | None:
    """The wall-clock bound of one first look at a store (a probe's call: :func:`info`, the output's write test):
    ``(connect_timeout + read_timeout) * max_attempts`` of the options in use (80 s with :data:`DEFAULTS`).

    The options' own timeouts do not bound every call: a first look may be several requests (s3fs's ``info`` is a
    HEAD, then a listing), and a PUT waits for the server's ``100 Continue`` with no timeout at all (aiohttp), so an
    endpoint that takes connections and never answers would hang it. fsspec's own ``timeout`` of a blocking call cuts
    it at this bound (:class:`fsspec.exceptions.FSTimeoutError`, said as a timeout by :func:`failure`). ``None`` (no
    bound) for a store whose options hold no such timeouts (gs://: gcsfs has its own)."""
    config = options_for(scheme, storage_options).get("config_kwargs")
    if not isinstance(config, Mapping) or "read_timeout" not in config:
        return None
    attempts = (config.get("retries") or {}).get("max_attempts", 5)
    return (float(config.get("connect_timeout", 60)) + float(config["read_timeout"])) * max(int(attempts), 1)


def error_type(where: str) -> type[Exception]:
    """The project's error for a bad ``where``: :class:`OutputError` for ``output.path``, else :class:`InputError`."""
    return OutputError if where.startswith("output") else InputError


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        return (response.get("Error") or {}).get("Code") or None
    return None


def endpoint(location: Location, storage_options: Mapping[str, Any] | None = None) -> str:
    """The endpoint the filesystem talks to, as far as the options and the environment say (for messages)."""
    given, _ = endpoint_setting(location, storage_options)
    return redact(given) if given else f"{location.store}'s own"


def failure(
    exc: BaseException,
    location: Location,
    where: str = "path",
    storage_options: Mapping[str, Any] | None = None,
    key: Location | None = None,
) -> Exception:
    """What went wrong with ``location`` (``where``: the config key that named it), in one line without a credential:
    an :class:`InputError` or :class:`OutputError`. ``key``: the object being read or written when it failed."""
    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    codes = {c for e in chain if (c := _code(e))}
    said = f"{where}={location.url!r}"
    store, at = location.store, endpoint(location, storage_options)
    set_by = endpoint_setting(location, storage_options)[1]
    verb = "write" if where.startswith("output") else "read"
    denied = f"access denied{_at(key)}; the credentials in use may not {verb} here"
    if names & _NO_CREDENTIALS:
        text = f"no {store} credentials found; {_HOW_TO_GIVE_CREDENTIALS[location.scheme]}"
    elif "NoSuchBucket" in codes:
        text = f"no such bucket {location.bucket!r} at the endpoint {at}; check its name and the endpoint"
    elif codes & _DENIED:
        text = denied
    elif codes & _REFUSED:
        text = f"the {store} credentials were refused ({', '.join(sorted(codes & _REFUSED))}); check or renew them"
    elif names & _TIMED_OUT:
        text = f"the endpoint {at} does not answer (timed out); check it ({set_by})"
    elif names & _UNREACHABLE:
        text = f"cannot connect to the endpoint {at}; check it ({set_by})"
    elif codes & {"NoSuchKey", "404", "NotFound"} or any(isinstance(e, FileNotFoundError) for e in chain):
        text = f"{(key or location).url!r} does not exist; check the prefix"
    elif any(isinstance(e, PermissionError) for e in chain):
        text = denied
    else:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        text = f"{store} failed{_at(key)}: {first}"
    return error_type(where)(redact(f"{said}: {text}", storage_options))


_NO_CREDENTIALS = {
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "DefaultCredentialsError"
}  # fmt: skip
_HOW_TO_GIVE_CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE, ~/.aws/credentials), an instance "
    "role, or runtime.storage_options.s3",
    "gs": "run gcloud auth application-default login, set GOOGLE_APPLICATION_CREDENTIALS, "
    "or runtime.storage_options.gs",
}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_REFUSED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
_TIMED_OUT = {
    "ConnectTimeoutError", "ReadTimeoutError", "TimeoutError", "ConnectionTimeoutError", "ServerTimeoutError",
    "FSTimeoutError",
}  # fmt: skip
_UNREACHABLE = {
    "EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError", "ConnectionError", "gaierror",
    "ClientConnectorDNSError",
}  # fmt: skip


def _at(key: Location | None) -> str:
    return f" on {key.url!r}" if key is not None else ""


def _secrets(storage_options: Mapping[str, Any] | None) -> list[str]:
    found = [os.environ[v] for v in SECRET_VARIABLES if os.environ.get(v)]

    def walk(node: Any, secret: bool) -> None:
        if isinstance(node, Mapping):
            for name, value in node.items():
                walk(value, secret or str(name).lower() in SECRET_KEYS)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value, secret)
        elif secret and node is not None and str(node):
            found.append(str(node))

    walk(storage_options or {}, False)
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def redact(text: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """``text`` without a credential: signed query values, a URL's user and password, AWS key IDs, and every secret
    of the environment (:data:`SECRET_VARIABLES`) and of ``storage_options`` (:data:`SECRET_KEYS`), each as ``***``."""
    for secret in _secrets(storage_options):
        text = text.replace(secret, REDACTED)
    text = _SIGNED.sub(lambda m: m.group(1) + REDACTED, text)
    text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    return _ACCESS_KEY_ID.sub(REDACTED, text)


def redacted_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` as it may be recorded (the manifest's config): every value under a :data:`SECRET_KEYS` key
    is ``***``, and a URL's user and password or signature are taken out."""

    def clean(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {
                name: (REDACTED if str(name).lower() in SECRET_KEYS and value is not None else clean(value))
                for name, value in node.items()
            }
        if isinstance(node, (list, tuple)):
            return [clean(v) for v in node]
        return redact(node) if isinstance(node, str) else node

    return clean(storage_options or {})


def info(location: Location, storage_options: Mapping[str, Any] | None = None, where: str = "input.path") -> dict:
    """fsspec's ``info`` of ``location`` (an object, or a prefix: ``type`` ``directory``), read now.

    Raises:
        InputError or OutputError: in one line (:func:`failure`), a missing bucket said as such, not as a missing key.
    """
    fs = filesystem(location, storage_options, where, probe=True)
    bound = first_look_s(location.scheme, storage_options)
    try:
        return fs.info(location.path, timeout=bound)
    except FileNotFoundError as exc:
        try:
            there = fs.exists(location.bucket, timeout=bound)
        except Exception:  # noqa: BLE001 - the first failure is the one to say
            there = True
        if not there:
            raise failure(_NoSuchBucket(), location, where, storage_options) from None
        raise failure(exc, location, where, storage_options) from None
    except Exception as exc:  # noqa: BLE001 - said in one line, whatever the backend raised
        raise failure(exc, location, where, storage_options) from None


class _NoSuchBucket(Exception):
    """A bucket found missing by a look at it, where the store's reply said only "not found"."""

    response = {"Error": {"Code": "NoSuchBucket"}}
