"""What both HTTP fronts read off a request: its tenant (the Authorization header) and its JSON body.

The chat, completions and embeddings routes (http) and the Files and Batch routes
(batch_http) import these; neither front imports the other's handlers.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from sluice_common.tenants import Tenant, TenantDirectory
from sluice_gateway.openai_front.errors import OpenAIError
from sluice_gateway.openai_front.requests import check_text


def authenticate(tenants: TenantDirectory, request: web.Request) -> Tenant:
    """The tenant whose key the request carries; 401 in OpenAI's shape when it carries none
    (a wrong key: Unauthenticated, which the fronts answer as 401 too)."""
    authorization = request.headers.get("Authorization")
    if not authorization:
        raise OpenAIError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <api key>`.", code="missing_api_key")
    return tenants.authenticate(authorization)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object of valid Unicode text, or the 400 / 413 saying what is wrong."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(413, f"The request body is larger than the limit of {request.client_max_size} bytes.", code="request_too_large") from None
    try:
        body = json.loads(raw)
    except ValueError as exc:
        # UnicodeDecodeError and JSONDecodeError are ValueErrors, and so is what Python raises for
        # an integer of over 4,300 digits (int_max_str_digits): every one the client's to fix.
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}. Send a JSON object.", code="invalid_json") from None
    except RecursionError:
        raise OpenAIError(400, "The JSON body of your request is nested too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    check_text(body)
    return body
