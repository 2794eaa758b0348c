"""RBAC in the emulated API server: every request is authorized against ``deploy/rbac.yaml`` (its
Role, bound by its RoleBinding to its ServiceAccount, applied in the cluster's namespace) for the
user its token authenticates; access reviews (``kubectl auth can-i``) are answered from the same
rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from trainer.emulation.api import ADMIN, RBAC_FILE, ApiError, qualified

DISCOVERY_PATHS = ("/api", "/apis", "/version", "/openapi", "/healthz", "/livez", "/readyz")
"""Non-resource URLs every authenticated user may get (the system:discovery and
system:public-info-viewer ClusterRoles)."""


_SELF_REVIEWS = ("selfsubjectaccessreviews", "selfsubjectrulesreviews")
"""What every authenticated user may create (the system:basic-user ClusterRole)."""


@dataclass(frozen=True, slots=True)
class Request:
    """What RBAC decides on: who asks for which verb on which resource where."""

    user: str
    verb: str
    group: str
    resource: str
    """With its subresource: ``pods/log``."""
    namespace: str
    name: str = ""


class Rbac:
    """The Roles and RoleBindings of ``deploy/rbac.yaml`` as applied with
    ``kubectl apply -n NAMESPACE``: a ServiceAccount may do what its bound Role's rules say,
    in that namespace only.
    """

    def __init__(self, namespace: str, rbac_file: Path = RBAC_FILE) -> None:
        docs = [d for d in yaml.safe_load_all(rbac_file.read_text()) if d]
        roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "Role"}
        self.namespace = namespace
        self.service_accounts = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
        self.rules: dict[str, list[tuple[str, str, dict]]] = {}  # user -> (binding, role, rule)
        for binding in (d for d in docs if d["kind"] == "RoleBinding"):
            role = binding["roleRef"]["name"]
            for subject in binding["subjects"]:
                user = f"system:serviceaccount:{subject.get('namespace', namespace)}:{subject['name']}"
                self.rules.setdefault(user, []).extend(
                    (binding["metadata"]["name"], role, rule) for rule in roles[role]
                )

    def allows(self, req: Request) -> bool:
        """Whether the request is granted (the admin always is)."""
        return self.reason(req) is not None

    def reason(self, req: Request) -> str | None:
        """Why the request is granted, as the RBAC authorizer says it (None: it is not)."""
        if req.user == ADMIN:
            return ""
        if req.group == "authorization.k8s.io" and req.resource in _SELF_REVIEWS and req.verb == "create":
            return (
                'RBAC: allowed by ClusterRoleBinding "system:basic-user" of ClusterRole "system:basic-user" '
                'to Group "system:authenticated"'
            )
        if req.namespace != self.namespace:
            return None
        for binding, role, rule in self.rules.get(req.user, []):
            if (
                _has(rule["apiGroups"], req.group)
                and _has(rule["resources"], req.resource)
                and _has(rule["verbs"], req.verb)
                and (not rule.get("resourceNames") or req.name in rule["resourceNames"])
            ):
                account = req.user.rsplit(":", 1)[1]
                return (
                    f'RBAC: allowed by RoleBinding "{binding}/{self.namespace}" of Role "{role}" '
                    f'to ServiceAccount "{account}/{self.namespace}"'
                )
        return None

    def review(self, user: str, review: dict) -> dict:
        """Answer a SelfSubjectAccessReview or SubjectAccessReview (``spec`` as sent) for ``user``.

        Raises:
            ApiError: 400 for a review without attributes.
        """
        spec = review.get("spec") or {}
        attrs, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if attrs:
            sub = attrs.get("subresource") or ""
            resource = attrs.get("resource", "") + (f"/{sub}" if sub else "")
            req = Request(
                user,
                attrs.get("verb", ""),
                attrs.get("group", ""),
                resource,
                attrs.get("namespace", ""),
                attrs.get("name", ""),
            )
            reason = self.reason(req)
        elif non_resource:
            allowed = user == ADMIN or (
                non_resource.get("verb") == "get"
                and any(non_resource.get("path", "").startswith(p) for p in DISCOVERY_PATHS)
            )
            reason = "" if allowed else None
        else:
            raise ApiError(
                400,
                "BadRequest",
                "spec: Invalid value: ...: exactly one of nonResourceAttributes "
                "or resourceAttributes must be specified",
            )
        status: dict = {"allowed": reason is not None}
        if reason:
            status["reason"] = reason
        return {**review, "metadata": {"creationTimestamp": None}, "status": status}


def _has(allowed: list[str], value: str) -> bool:
    return "*" in allowed or value in allowed


def forbidden(req: Request) -> ApiError:
    """``403 Forbidden`` worded like the real RBAC authorizer's refusal."""
    what = (
        f'{qualified(req.resource.split("/")[0])} "{req.name}"' if req.name else qualified(req.resource.split("/")[0])
    )
    sub = req.resource.split("/", 1)[1] if "/" in req.resource else ""
    resource = req.resource.split("/")[0]
    where = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
    message = (
        f'{what} is forbidden: User "{req.user}" cannot {req.verb} resource "{resource}"'
        + (f' with subresource "{sub}"' if sub else "")
        + f' in API group "{req.group}" {where}'
    )
    return ApiError(
        403, "Forbidden", message, {"name": req.name, "group": req.group, "kind": resource} if req.name else None
    )


# ------------------------------------------------------------------ access reviews in protobuf
# client-go's clientsets send built-in kinds as protobuf (``kubectl auth can-i``); the server
# answers in JSON, which they accept too. Only the access reviews are decoded.
PROTOBUF = "application/vnd.kubernetes.protobuf"
_RESOURCE_ATTRIBUTES = ("namespace", "verb", "group", "version", "resource", "subresource", "name")


def review_from_protobuf(raw: bytes) -> dict:
    """A SelfSubjectAccessReview or SubjectAccessReview sent as Kubernetes protobuf (the ``k8s NUL``
    envelope around a ``runtime.Unknown``), as the JSON object it stands for.

    Raises:
        ApiError: 415 for any other kind, 400 for bytes that do not decode.
    """
    try:
        if not raw.startswith(b"k8s\x00"):
            raise ValueError("no k8s protobuf envelope")
        unknown = _fields(raw[4:])
        type_meta = _fields(unknown[1][0])
        api_version, kind = type_meta.get(1, [b""])[0].decode(), type_meta.get(2, [b""])[0].decode()
        if kind not in ("SelfSubjectAccessReview", "SubjectAccessReview"):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the emulated server decodes no {kind or 'object'} sent as {PROTOBUF}: send JSON",
            )
        spec_fields = _fields(_fields(unknown[2][0]).get(2, [b""])[0])
        spec: dict = {}
        if 1 in spec_fields:
            attrs = _fields(spec_fields[1][0])
            spec["resourceAttributes"] = {
                k: attrs[i + 1][0].decode() for i, k in enumerate(_RESOURCE_ATTRIBUTES) if i + 1 in attrs
            }
        if 2 in spec_fields:
            attrs = _fields(spec_fields[2][0])
            spec["nonResourceAttributes"] = {
                k: attrs[i + 1][0].decode() for i, k in enumerate(("path", "verb")) if i + 1 in attrs
            }
        if kind == "SubjectAccessReview":
            if 3 in spec_fields:
                spec["user"] = spec_fields[3][0].decode()
            spec["groups"] = [g.decode() for g in spec_fields.get(4, [])]
        return {"kind": kind, "apiVersion": api_version, "metadata": {}, "spec": spec}
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, AttributeError) as e:
        raise ApiError(400, "BadRequest", f"the body of the request could not be decoded as {PROTOBUF}: {e}") from e


def _fields(data: bytes) -> dict[int, list]:
    """The fields of a protobuf message: number -> values (bytes for length-delimited ones)."""
    out: dict[int, list] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            value, i = data[i : i + size], i + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, i = data[i : i + width], i + width
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i
