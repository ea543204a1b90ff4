"""Accounts, tokens, rate limits, faults and the request log of the local Hub.

Tokens (kept in ``<root>/tokens.json``, mode 0600, made on first start): a write token and a
read-only token for the user (``--user``, default ``me``), and an admin token for ``/admin``;
``POST /admin/tokens`` makes fine-grained tokens scoped to named resources (``bucket:me/run``,
``space:me/x``) with read or write, and revokes or restores any token.

How the Hub answers (huggingface.co/docs/hub/security-tokens, and huggingface_hub 2.4.0's
``utils/_http.py`` ``hf_raise_for_status``, which is what a client reads): a missing or unknown
token on a route that needs one is 401 (``X-Error-Message: Invalid credentials in Authorization
header`` for an unknown one); a token without the permission is 403.

Rate limits (huggingface.co/docs/hub/rate-limits, figures as docs/SCALE.md uses them): per token
(per client address when anonymous), fixed 5-minute windows, counted separately for the API
(``/api/...``) and the resolver (``/.../resolve/...``); past the limit the answer is 429 with
``Retry-After`` and ``RateLimit: "api";r=0;t=<seconds to the window's end>`` (the header
huggingface_hub's ``parse_ratelimit_headers`` reads), and ``RateLimit-Policy``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path

from fastapi import HTTPException, Request

WINDOW_S = 300  # the Hub's fixed rate-limit window (docs/SCALE.md)
DEFAULT_LIMITS = {"api": 1000, "resolver": 5000}  # free tier per window (docs/SCALE.md)


@dataclasses.dataclass
class Token:
    """One access token. ``role``: ``write``, ``read``, ``fine-grained`` or ``admin``;
    ``scopes``: for a fine-grained token, ``{resource: "read" | "write"}``."""

    name: str
    value: str
    user: str
    role: str
    scopes: dict[str, str] = dataclasses.field(default_factory=dict)
    revoked: bool = False

    def allows(self, write: bool, resource: str | None) -> bool:
        """Whether this token may read (or with ``write``, write) ``resource``."""
        if self.role == "admin":
            return True
        if self.role in ("write", "read"):
            return self.role == "write" or not write
        if resource is None:
            return not write
        perm = self.scopes.get(resource)
        return perm == "write" or (perm == "read" and not write)


def classify(path: str) -> str | None:
    """``"api"``, ``"resolver"`` or None (not counted: the admin routes, the CAS, the bridge)."""
    if path.startswith("/api/"):
        return "api"
    if re.match(r"^/(buckets|datasets|spaces)/.+/resolve/", path) or "/resolve/" in path:
        return "resolver"
    return None


class Accounts:
    """Tokens, authorization, rate limits, faults and the request log (one per Hub process).

    Args:
        root: the Hub's state folder (tokens.json, requests.jsonl).
        user: the account the default tokens belong to.
        limits: requests per 5-minute window by class (``{"api": 1000, "resolver": 5000}``).
        clock: ``time.time`` (tests may pass another).
    """

    def __init__(self, root: Path, user: str = "me", limits: dict | None = None, clock=time.time):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.limits = dict(DEFAULT_LIMITS, **(limits or {}))
        self.clock = clock
        self._lock = threading.Lock()
        self._path = self.root / "tokens.json"
        self.tokens: dict[str, Token] = {}
        if self._path.exists():
            for t in json.loads(self._path.read_text()):
                self.tokens[t["value"]] = Token(**t)
        else:
            for role in ("write", "read", "admin"):
                self.add(user, role, name=f"{user}-{role}")
        self._windows: dict[tuple[str, str, int], int] = {}
        self.faults: list[dict] = []
        self._log = open(self.root / "requests.jsonl", "a", buffering=1, encoding="utf-8")

    # ------------------------------------------------------------------------- tokens
    def add(self, user: str, role: str, scopes: dict | None = None, name: str | None = None):
        """Make a token and save the token file; returns the :class:`Token`.

        Raises:
            ValueError: an unknown role, or scopes on a role that is not fine-grained.
        """
        if role not in ("write", "read", "fine-grained", "admin"):
            raise ValueError(f"expected role write, read, fine-grained or admin, found {role!r}")
        if scopes and role != "fine-grained":
            raise ValueError(f"expected scopes only on a fine-grained token, found role {role!r}")
        token = Token(
            name or f"{user}-{role}-{len(self.tokens)}",
            "hf_" + secrets.token_hex(16),
            user,
            role,
            dict(scopes or {}),
        )
        with self._lock:
            self.tokens[token.value] = token
            self._save()
        return token

    def by_name(self, name: str) -> Token:
        """The token called ``name``. Raises KeyError when there is none."""
        for t in self.tokens.values():
            if t.name == name:
                return t
        raise KeyError(
            f"no token named {name!r}; known: {sorted(t.name for t in self.tokens.values())}"
        )

    def set_revoked(self, name: str, revoked: bool) -> Token:
        """Revoke (or restore) the token called ``name``."""
        with self._lock:
            token = self.by_name(name)
            token.revoked = revoked
            self._save()
        return token

    def _save(self) -> None:
        tmp = self._path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump([dataclasses.asdict(t) for t in self.tokens.values()], f, indent=1)
        os.replace(tmp, self._path)

    def token_of(self, request: Request, revoked: bool = False) -> Token | None:
        """The request's bearer token (None when it sends none, or one the Hub does not know;
        a revoked one only with ``revoked``, as the request log names it)."""
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            return None
        token = self.tokens.get(auth[7:].strip())
        return None if token is None or (token.revoked and not revoked) else token

    def authorize(self, request: Request, *, write: bool, resource: str | None = None) -> str:
        """The user owning the request's token.

        A user writes only under their own namespace (``resource`` ``kind:owner/name``).

        Raises:
            HTTPException: 401 without a (known, unrevoked) token; 403 when the token lacks the
                permission or the scope, or writes another user's namespace.
        """
        token = self.token_of(request)
        if token is None:
            sent = request.headers.get("authorization")
            raise HTTPException(
                401,
                "Invalid credentials in Authorization header" if sent else "Unauthorized",
                headers={"X-Error-Message": "Invalid credentials in Authorization header"}
                if sent
                else None,
            )
        owner = resource.split(":", 1)[1].split("/")[0] if resource else None
        if not token.allows(write, resource) or (write and owner not in (None, token.user)):
            what = "write" if write else "read"
            msg = f"This token ({token.role}) has no {what} access to {resource or 'this route'}"
            raise HTTPException(403, msg, headers={"X-Error-Message": msg})
        return token.user

    # --------------------------------------------------------------------- rate limits
    def throttle(self, request: Request, kind: str) -> dict | None:
        """Count a request of class ``kind`` against its token's window; the 429 headers when it
        is past the limit (the request is then not served), else None."""
        token = self.token_of(request)
        who = token.name if token else f"ip:{request.client.host if request.client else '?'}"
        now = self.clock()
        window = int(now // WINDOW_S)
        with self._lock:
            key = (who, kind, window)
            self._windows[key] = count = self._windows.get(key, 0) + 1
            for k in [k for k in self._windows if k[2] < window - 1]:
                del self._windows[k]
        if count <= self.limits[kind]:
            return None
        reset = max(1, int((window + 1) * WINDOW_S - now + 0.999))
        return rate_limit_headers(kind, self.limits[kind], reset)

    # --------------------------------------------------------------------------- faults
    def add_fault(self, fault: dict) -> dict:
        """Arm a fault: ``{"kind": "429"|"503"|"slow"|"drop", "count": N | "seconds": S,
        "match": <path regex>, "token": <token name>, "delay_s": <for slow>}``.

        Raises:
            ValueError: an unknown kind, or neither count nor seconds.
        """
        if fault.get("kind") not in ("429", "503", "slow", "drop"):
            raise ValueError(
                f"expected fault kind 429, 503, slow or drop, found {fault.get('kind')!r}"
            )
        if "count" not in fault and "seconds" not in fault:
            raise ValueError("expected a fault with 'count' (requests) or 'seconds' (a duration)")
        fault = dict(fault, armed_at=self.clock(), hits=0)
        with self._lock:
            self.faults.append(fault)
        return fault

    def fault_for(self, request: Request) -> dict | None:
        """The armed fault this request meets (and counts it), or None."""
        now = self.clock()
        token = self.token_of(request)
        with self._lock:
            for f in list(self.faults):
                over = ("count" in f and f["hits"] >= f["count"]) or (
                    "seconds" in f and now - f["armed_at"] > f["seconds"]
                )
                if over:
                    self.faults.remove(f)
                    continue
                if f.get("match") and not re.search(f["match"], request.url.path):
                    continue
                if f.get("token") and (token is None or token.name != f["token"]):
                    continue
                f["hits"] += 1
                return f
        return None

    # ------------------------------------------------------------------------------ log
    def log(
        self,
        request: Request,
        status: int,
        kind: str | None,
        seconds: float,
        size: int,
        who: str | None = None,
    ):
        """One JSON line per request in ``requests.jsonl`` (never a token's value): ``size``
        bytes sent, ``in`` bytes received (``Content-Length``); ``who``: the token's name when the
        request carries no Hub token (the CAS's Xet tokens and signed URLs name theirs)."""
        token = self.token_of(request, revoked=True)
        line = {
            "t": round(self.clock(), 3),
            "token": token.name if token else who,
            "in": int(request.headers.get("content-length") or 0),
            "client": request.headers.get("user-agent", "")[:120],
            "kind": kind,
            "method": request.method,
            "path": request.url.path,
            "status": status,
            "bytes": size,
            "ms": round(seconds * 1000, 1),
        }
        with self._lock:
            self._log.write(json.dumps(line) + "\n")


def rate_limit_headers(kind: str, limit: int, reset_s: int) -> dict[str, str]:
    """The headers of a 429 past ``limit`` requests of ``kind``, ``reset_s`` to the window's end."""
    return {
        "Retry-After": str(reset_s),
        "RateLimit": f'"{kind}";r=0;t={reset_s}',
        "RateLimit-Policy": f'"fixed window";"{kind}";q={limit};w={WINDOW_S}',
    }


def count_requests(path: Path, since: float = 0.0) -> dict:
    """Requests in a ``requests.jsonl`` at or after ``since`` (unix seconds), by token and class:
    ``{token: {"api": n, "resolver": n, "cas": n, "other": n, "bytes": n, "bytes_in": n}}``
    (``cas``: requests to the Xet CAS and the file bridge, which the Hub's limits do not count;
    ``bytes``: bytes sent to the token's holder, ``bytes_in``: bytes it sent)."""
    counts: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = json.loads(raw)
            if line["t"] < since:
                continue
            c = counts.setdefault(
                line["token"] or "anonymous",
                {"api": 0, "resolver": 0, "cas": 0, "other": 0, "bytes": 0, "bytes_in": 0},
            )
            c[line["kind"] or "other"] += 1
            c["bytes"] += line["bytes"]
            c["bytes_in"] += line.get("in", 0)
    return counts
