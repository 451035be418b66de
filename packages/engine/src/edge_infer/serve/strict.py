"""OpenAI-strict input checks that vLLM's server does not make, as one HTTP middleware that
`edge-infer serve` passes to vLLM (`--middleware edge_infer.serve.strict.check_request`).

- A chat message whose role OpenAI's API does not know (`"role": "wizard"`) is a 400 with a
  message naming it, as OpenAI answers it. vLLM renders it through the chat template instead
  and answers 200.

Anything this module cannot parse (malformed JSON, a body that is not an object) goes on to
vLLM, whose own validation answers it.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_PATH = "/v1/chat/completions"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def bad_role(payload: Any) -> str | None:
    """The error message for the first message with an unknown role, or None."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        return None
    for i, message in enumerate(payload["messages"]):
        if isinstance(message, dict) and "role" in message and message["role"] not in ROLES:
            return (f"messages[{i}].role: {message['role']!r} is not a chat role; "
                    f"expected one of {', '.join(ROLES)}")
    return None


async def check_request(request, call_next):
    if request.method == "POST" and request.url.path == CHAT_PATH:
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            payload = None
        message = bad_role(payload)
        if message is not None:
            from starlette.responses import JSONResponse

            # the shape of vLLM's own 400s (ErrorResponse), which OpenAI clients parse
            return JSONResponse(status_code=400, content={"error": {
                "message": message, "type": "BadRequestError", "param": "messages", "code": 400}})
    return await call_next(request)
