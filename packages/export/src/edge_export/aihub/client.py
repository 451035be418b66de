"""AI Hub credentials and reachability, checked before anything heavy happens.

Credentials come only from qai-hub's own config file: `$QAIHUB_CLIENT_INI`, else
`~/.qai_hub/client.ini` (qai_hub 0.56 api_utils.get_config_path; a test keeps us in step).
qai-hub raises on a missing file only at the first call, and on a bad network retries with
back-off for ~45 s before saying anything; we check both first, in well under a second, and
fail with one line. The API token is never printed, logged or recorded: messages name the
file and the host only, and `redact` scrubs it from any text we pass on from the client.
"""

from __future__ import annotations

import configparser
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from edge_infer.api import EdgeInferError

CONFIGURE_HINT = ("create it with `qai-hub configure --api_token <token>` (the token is in your "
                  "AI Hub account settings)")


class AIHubUnavailable(EdgeInferError):
    """No credentials, or the service cannot be reached: nothing was submitted."""


@dataclass(frozen=True)
class HubConfig:
    path: Path
    api_url: str
    _token: str  # kept only to redact it; never formatted

    def __repr__(self) -> str:  # dataclass repr would show the token
        return f"HubConfig(path={str(self.path)!r}, api_url={self.api_url!r})"

    def redact(self, text: str) -> str:
        return text.replace(self._token, "<token>") if self._token else text


def config_path() -> Path:
    return Path(os.environ.get("QAIHUB_CLIENT_INI", "~/.qai_hub/client.ini")).expanduser()


def read_config() -> HubConfig:
    path = config_path()
    if not path.is_file():
        raise AIHubUnavailable(f"no AI Hub credentials: {path} does not exist; {CONFIGURE_HINT}")
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
        api = parser["api"]
        api_url, token = api["api_url"], api["api_token"]
    except (configparser.Error, KeyError):
        raise AIHubUnavailable(
            f"AI Hub config {path} lacks [api] api_url/api_token; {CONFIGURE_HINT}") from None
    if not token.strip():
        raise AIHubUnavailable(f"AI Hub config {path} has an empty api_token; {CONFIGURE_HINT}")
    return HubConfig(path, api_url, token)


def _proxy_for(url: str) -> str | None:
    scheme = urlparse(url).scheme or "https"
    for key in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        if os.environ.get(key):
            return os.environ[key]
    return None


def check_reachable(api_url: str, timeout: float = 5.0) -> None:
    """One TCP connect to the API host (or the proxy that requests would use)."""
    target = _proxy_for(api_url) or api_url
    parsed = urlparse(target if "://" in target else f"http://{target}")
    host = parsed.hostname
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host:
        raise AIHubUnavailable(f"AI Hub api_url {api_url!r} has no host; {CONFIGURE_HINT}")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        via = f" (through proxy {host}:{port})" if target != api_url else ""
        raise AIHubUnavailable(
            f"AI Hub at {urlparse(api_url).hostname} is unreachable{via}: {why}; "
            "nothing was submitted; check the network and retry"
        ) from None


def connect(timeout: float = 5.0):
    """A qai_hub.Client on the user's config, after both checks; returns (client, config)."""
    config = read_config()
    check_reachable(config.api_url, timeout)
    import qai_hub

    return qai_hub.Client(), config
