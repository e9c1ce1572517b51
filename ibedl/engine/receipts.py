"""Signed feedback receipts: what an answer decided, signed with the service's key (HMAC-SHA256), so that any
replica holding the key can check a label sent back for it without having seen the question (stateless: nothing
is stored when a question is answered).

A receipt is ``v1.<payload>.<mac>``: the payload is compact JSON in base64url (no padding), the mac is
HMAC-SHA256(key, ``v1.<payload>``) in base64url. The payload is readable by whoever holds the receipt (it holds
nothing the answer did not show); it cannot be changed without the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import asdict, dataclass

from ibedl.engine.errors import InvalidReceipt, ReceiptExpired

VERSION = "v1"
MAX_RECEIPT_CHARS = 4096


@dataclass(frozen=True)
class Receipt:
    """What one answer decided.

    Attributes:
        id: the receipt's own id (32 hex digits, random): a label counts once per id.
        question: the answer's ``id``.
        adapter, version: the adapter that answered and its manifest version.
        options: how many options the question had (a label must be one of them).
        predicted: index of the predicted option.
        answered: False when the service abstained.
        set: indices of the conformal prediction set, None without one; ``coverage`` its nominal 1 - alpha.
        adaptive_set, adaptive_coverage: the adaptive (ACI) rule's set and its target coverage, None when off; the
            set is empty when the rule's threshold was below every option's score (the answer then showed the most
            probable option alone; the label counts as a miss for the threshold: ibedl.engine.adaptive).
        target: the answered accuracy the adapter's abstention states, None when it states none.
        probs: the answer's probabilities (6 decimals); ``alpha`` its Dirichlet concentration, None without: what
            a recalibration on the labelled traffic needs (``python -m ibedl.training.calibrate --dataset feedback``).
        issued, expires: unix seconds.
        calibration: the backend and precision of the calibration that answered (``torch-fp32``, ``openvino-int8``,
            ...): the arithmetic ``probs`` were computed on, which a recalibration on them is made for; None in
            receipts signed before it was recorded.
    """

    id: str
    question: str
    adapter: str
    version: str
    options: int
    predicted: int
    answered: bool
    set: tuple[int, ...] | None
    coverage: float | None
    adaptive_set: tuple[int, ...] | None
    adaptive_coverage: float | None
    target: float | None
    probs: tuple[float, ...]
    alpha: tuple[float, ...] | None
    issued: int
    expires: int
    calibration: str | None = None


def new_id() -> str:
    return secrets.token_hex(16)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, signed: str) -> str:
    return _b64(hmac.new(key, signed.encode("ascii"), hashlib.sha256).digest())


def sign(receipt: Receipt, key: bytes) -> str:
    """The receipt as a token ``v1.<payload>.<mac>``."""
    if not key:
        raise ValueError("the receipt key must not be empty")
    payload = _b64(json.dumps(asdict(receipt), separators=(",", ":"), sort_keys=True).encode("utf-8"))
    signed = f"{VERSION}.{payload}"
    return f"{signed}.{_mac(key, signed)}"


def verify(token: str, key: bytes, now: float, field: str = "receipt") -> Receipt:
    """The receipt a token carries, if ``key`` signed it and it has not expired at ``now`` (unix seconds).

    Raises:
        InvalidReceipt: not a receipt, or not signed with ``key`` (tampered with, forged, another service's).
        ReceiptExpired: signed, but ``now`` is past its expiry.
    """
    if not isinstance(token, str) or len(token) > MAX_RECEIPT_CHARS or token.count(".") != 2:
        raise InvalidReceipt("not a receipt of this service: expected the 'receipt' string of a /predict answer",
                             field)
    version, payload, mac = token.split(".")
    if version != VERSION:
        raise InvalidReceipt(f"unknown receipt version {version[:10]!r}; expected {VERSION}", field)
    if not hmac.compare_digest(_mac(key, f"{version}.{payload}"), mac):
        raise InvalidReceipt("the receipt's signature does not match: it was changed, or another service (or key) "
                             "signed it", field)
    try:
        body = json.loads(_unb64(payload))
        receipt = Receipt(**{**body, "set": _indices(body["set"]), "adaptive_set": _indices(body["adaptive_set"]),
                             "probs": tuple(body["probs"]), "alpha": None if body["alpha"] is None else
                             tuple(body["alpha"])})
    except (binascii.Error, ValueError, TypeError, KeyError) as e:  # signed by us, so only a format change gets here
        raise InvalidReceipt(f"the receipt cannot be read ({type(e).__name__})", field) from None
    if now > receipt.expires:
        raise ReceiptExpired(f"the receipt expired {int(now - receipt.expires)} s ago (receipts are accepted for "
                             f"{receipt.expires - receipt.issued} s after the answer)", field)
    return receipt


def _indices(value) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(i) for i in value)
