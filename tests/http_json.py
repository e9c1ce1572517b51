"""The one way tests read an HTTP response's JSON body: its status is asserted first (with the body in the message),
so a body is never compared, or indexed, before the test knows which response it is."""

from __future__ import annotations


def ok_json(response, status: int = 200):
    """``response.json()`` once ``response.status_code == status`` (httpx or Starlette's TestClient response)."""
    assert response.status_code == status, f"HTTP {response.status_code} (expected {status}): {response.text[:2000]}"
    return response.json()
