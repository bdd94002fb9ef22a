"""Peer authentication for the control connection.

Authentication (when the engines share a secret) is a mutual
challenge-response with HMAC-SHA256 over both nonces: the secret never
crosses the wire, and each side proves itself before the other hands out a
session token or a descriptor.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any

from kvflow.errors import AuthenticationError

__all__ = ["NONCE_BYTES", "check_proof", "proof"]

NONCE_BYTES = 32


def proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def check_proof(secret: bytes, label: bytes, first: bytes, second: bytes, got: Any) -> None:
    if not isinstance(got, bytes) or not hmac.compare_digest(proof(secret, label, first, second), got):
        raise AuthenticationError("secret mismatch: the peer could not prove it knows the secret")
