"""The API key on every route, as one ASGI middleware that `edge-infer serve` passes to vLLM
(`--middleware edge_infer.serve.auth.RequireKey`).

vLLM's own `--api-key` guards only the paths under /v1, /v2, /inference and /cohere. Its
/tokenize, /detokenize, /invocations, /metrics, /version, /server_info and any router a later
vLLM adds stay open. Here the rule is the other way round: every path needs the key except
OPEN (liveness probes carry no key), and /metrics too unless `--metrics-open`.

The key comes from the environment (KEY_ENV), never from argv: `ps` shows a process's argv to
every user of the machine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_ENV = "EDGE_INFER_API_KEY"
METRICS_OPEN_ENV = "EDGE_INFER_METRICS_OPEN"
OPEN = ("/health", "/ping")
METRICS = "/metrics"


def is_open(path: str, metrics_open: bool) -> bool:
    path = path.rstrip("/") or "/"
    return path in OPEN or (metrics_open and (path == METRICS or path.startswith(METRICS + "/")))


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class RequireKey:
    """Pure ASGI middleware: 401 for any http or websocket request to a guarded path without
    `Authorization: Bearer KEY`. With no key in the environment it passes everything through
    (`serve` warns about that at start)."""

    def __init__(self, app, key: str | None = None, metrics_open: bool | None = None) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV) if key is None else key
        self.digest = hashlib.sha256(key.encode()).digest() if key else None
        if metrics_open is None:
            metrics_open = os.environ.get(METRICS_OPEN_ENV, "") not in ("", "0")
        self.metrics_open = metrics_open

    def allowed(self, scope) -> bool:
        if self.digest is None or scope.get("method") == "OPTIONS":
            return True  # CORS preflights carry no credentials by design
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if is_open(path, self.metrics_open):
            return True
        token = bearer(scope.get("headers", []))
        # compare digests: equal length, constant time
        return token is not None and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
        else:
            body = json.dumps({"error": {
                "message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "type": "AuthenticationError", "param": None, "code": 401}}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
