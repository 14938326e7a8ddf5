"""The checks of a topology's keys: each takes the YAML value and returns the spec's value, or
raises :class:`Bad` with the one line that says what is wrong."""

from __future__ import annotations

import math
import re
from typing import Any, Callable
from urllib.parse import urlsplit

from cluster.engine.request_limits import quote
from cluster.engine.speculative.config import METHODS
from cluster.engine.speculative.prompt_kv import PLACES

Check = Callable[[Any], Any]

CLUSTER_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class Bad(Exception):
    """A value's problem; ``sub`` is appended to the key (a key inside the value)."""

    def __init__(self, message: str, sub: str = ""):
        super().__init__(message)
        self.sub = sub


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"{quote(value)} (a string)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return quote(value)


def integer(low: int, high: int | None = None, null: bool = False) -> Check:
    wanted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def check(value: Any) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise Bad(f"must be {wanted}{' or null' if null else ''}; got {describe(value)}")
        return value

    return check


def number(low: float, high: float | None = None, null: bool = False, inclusive: bool = False) -> Check:
    wanted = (f"a number {'>=' if inclusive else '>'} {low:g}" if high is None
              else f"a number in {'[' if inclusive else '('}{low:g}, {high:g}]")

    def check(value: Any) -> float | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < low or (value == low and not inclusive) or (high is not None and value > high):
            raise Bad(f"must be {wanted}{' or null' if null else ''}; got {describe(value)}")
        return float(value)

    return check


def string(null: bool = False, pattern: re.Pattern | None = None, rule: str = "") -> Check:
    def check(value: Any) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str) or not value:
            raise Bad(f"must be a non-empty string{' or null' if null else ''}; got {describe(value)}")
        if pattern is not None and not pattern.match(value):
            raise Bad(f"{quote(value)} {rule}")
        return value

    return check


def choice(choices: tuple, null: bool = False, names: str = "") -> Check:
    names = names or ", ".join(map(str, choices))

    def check(value: Any) -> Any:
        if value is None and null:
            return None
        if isinstance(value, bool) or value not in choices:
            raise Bad(f"must be one of {names}{' or null' if null else ''}; got {describe(value)}")
        return value

    return check


speculative_method = choice(METHODS)
draft_prompt_kv = choice(PLACES)


def host_cache(value: Any) -> int | str | None:
    from cluster.engine.kv_tiers.size import parse_host_cache

    try:
        parse_host_cache(value)
    except ValueError as exc:
        raise Bad(str(exc)) from None
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Bad(f"must be true or false; got {describe(value)}")
    return value


def url(value: Any) -> str | None:
    text = string(null=True)(value)
    if text is not None:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise Bad(f"must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:9090; got {quote(text)}")
    return text


def env_name(value: Any) -> str | None:
    return string(null=True, pattern=ENV_NAME, rule="is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")(value)


def cluster_name(value: Any) -> str:
    return string(pattern=CLUSTER_NAME, rule="must be 1-63 characters of a-z, 0-9 and '-', "
                                             "starting and ending with a letter or digit")(value)


def resources(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Bad(f"must be a mapping of Ray resource name to amount; got {describe(value)}")
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise Bad(f"resource names must be non-empty strings; got {describe(name)}", str(name))
        if name in RAY_BUILTIN_RESOURCES:
            raise Bad(f"{name} is not a custom resource: set cpus_per_rank and gpus_per_rank instead", name)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise Bad(f"must be a number > 0; got {describe(amount)}", name)
    return {name: float(amount) for name, amount in value.items()}


def transport(value: Any) -> str:
    from cluster.kv_transfer.transport import TransportError
    from cluster.kv_transfer.transports import check_transport

    name = string()(value)
    try:
        check_transport(name)
    except TransportError as exc:
        raise Bad(str(exc)) from None
    return name


def redis_url(value: Any) -> str | None:
    # The URL may hold a password: messages never repeat it.
    text = string(null=True)(value)
    if text is None:
        return None
    shape = "must look like redis://[:password@]host:port/db or rediss://... (TLS)"
    parts = urlsplit(text)
    if parts.scheme not in ("redis", "rediss"):
        raise Bad(f"{shape}; the scheme is {parts.scheme or 'missing'}")
    try:
        parts.port
    except ValueError:
        raise Bad(f"{shape}; the port is not a number in 0..65535") from None
    if not parts.hostname:
        raise Bad(f"{shape}; the host is missing")
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise Bad(f"{shape}; the database must be a number")
    return text
