"""The API-server half of the emulated cluster (``trainer.emulation.cluster``).

A kube-apiserver on loopback (plain http on 127.0.0.1) for the calls the train step's kubernetes
path makes: PyTorchJobs (``kubeflow.org/v1``, create / get / list / delete) and pods (list / get /
delete / ``log``, ``follow=true`` included). It does what the real server does with them:

- **admission**: a PyTorchJob is checked against the vendored CRD's structural schema
  (``deploy/crds/``): unknown fields are pruned with a ``Warning`` header (the server's default
  field validation) or refused (``?fieldValidation=Strict``), schema defaults are applied, a wrong
  type or enum is refused as ``422 Invalid``; then the training operator's validating webhook rules;
- **storage**: a second create of a name is ``409 AlreadyExists``; uid, resourceVersion,
  generation and creationTimestamp are set by the server; ``status`` is the operator's alone;
- **deletion** honours ``propagationPolicy``: Background (the default for custom resources: the
  job is gone at once, its pods are then deleted by the garbage collector), Foreground (the job
  keeps a ``deletionTimestamp`` until its pods are gone, then 404) and Orphan; pods are deleted
  gracefully (``deletionTimestamp``, SIGTERM, ``terminationGracePeriodSeconds``, SIGKILL, gone);
- **label selectors** (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``) and namespaces;
- **RBAC**: every request is authorized against ``deploy/rbac.yaml`` (its Role, bound by its
  RoleBinding to its ServiceAccount, applied in the cluster's namespace) for the token the
  kubeconfig carries; refusals are ``403 Forbidden`` Status objects worded like the real ones;
- every error is a ``Status`` object with the real reason and code.

Nothing here imports a Kubernetes client: the tests drive it with the real ones.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "deploy" / "crds" / "kubeflow.org_pytorchjobs.v1.9.4.yaml"
RBAC_FILE = REPO / "deploy" / "rbac.yaml"
GROUP, VERSION, KIND, PLURAL = "kubeflow.org", "v1", "PyTorchJob", "pytorchjobs"
ADMIN = "system:admin"
"""The user of the admin kubeconfig (tests, kubectl): a member of system:masters, never checked."""
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_META_FIELDS = {"name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences"}
_SERVER_META = {
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
}


def now_rfc3339() -> str:
    """The current time as Kubernetes writes timestamps."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ApiError(Exception):
    """A request the server refuses; ``status()`` is the Status object it answers with."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        """The ``Status`` object (kind Status, status Failure) of this error."""
        out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message}
        out.update({"reason": self.reason, "code": self.code})
        if self.details:
            out["details"] = self.details
        return out


def _qualified(resource: str) -> str:
    return f"{resource}.{GROUP}" if resource == PLURAL else resource


def not_found(resource: str, name: str) -> ApiError:
    """``404 NotFound`` for ``name``, worded like the real server."""
    kind = resource.split("/")[0]
    return ApiError(404, "NotFound", f'{_qualified(kind)} "{name}" not found', {"name": name, "kind": kind})


# ------------------------------------------------------------------ the structural schema
class CrdSchema:
    """The PyTorchJob CRD's ``openAPIV3Schema``, applied as the API server applies a structural
    schema: prune unknown fields, apply defaults, validate.
    """

    def __init__(self, crd_file: Path = CRD_FILE) -> None:
        import jsonschema  # the dev extra; only the emulator (test tooling) needs it

        crd = next(d for d in yaml.safe_load_all(crd_file.read_text()) if d and d.get("kind") == "CustomResourceDefinition")
        version = next(v for v in crd["spec"]["versions"] if v["name"] == VERSION)
        self.schema = version["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft7Validator(self.schema)

    def admit(self, obj: dict, *, field_validation: str) -> list[str]:
        """Prune, default and validate ``obj`` in place (its ``spec``; metadata and status are the
        server's). Returns the warnings (unknown fields under the default ``Warn``).

        Raises:
            ApiError: 400 for unknown fields under ``Strict``, 422 for invalid values.
        """
        unknown: list[str] = []
        for key in [k for k in obj if k not in ("apiVersion", "kind", "metadata", "spec", "status")]:
            unknown.append(key)
            del obj[key]
        if "spec" in obj:
            _prune(obj["spec"], self.schema["properties"]["spec"], "spec", unknown)
            _default(obj["spec"], self.schema["properties"]["spec"])
        if unknown and field_validation == "Strict":
            listed = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(
                400, "BadRequest", f'{KIND} in version "{VERSION}" cannot be handled as a {KIND}: strict decoding error: {listed}'
            )
        errors = sorted(self.validator.iter_errors({k: v for k, v in obj.items() if k != "metadata"}), key=lambda e: list(e.absolute_path))
        if errors:
            causes = [{"reason": "FieldValueInvalid", "message": e.message, "field": _field_path(e.absolute_path)} for e in errors]
            text = "; ".join(
                f"{c['field']}: Invalid value: {json.dumps(e.instance)}: {c['message']}" for c, e in zip(causes, errors, strict=True)
            )
            name = obj.get("metadata", {}).get("name", "")
            raise ApiError(
                422,
                "Invalid",
                f'{KIND}.{GROUP} "{name}" is invalid: {text}',
                {"name": name, "group": GROUP, "kind": KIND, "causes": causes},
            )
        return [f'unknown field "{u}"' for u in unknown] if field_validation != "Ignore" else []


def _field_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def _prune(node: Any, schema: dict, path: str, unknown: list[str]) -> None:
    """Drop fields the schema does not declare (recording their paths), as the server does."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(node, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in node.items():
                _prune(value, extra, f"{path}.{key}", unknown)
            return
        for key in list(node):
            if props is None or key not in props:
                unknown.append(f"{path}.{key}")
                del node[key]
            else:
                _prune(node[key], props[key], f"{path}.{key}", unknown)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(node):
            _prune(item, schema["items"], f"{path}[{i}]", unknown)


def _default(node: Any, schema: dict) -> None:
    """Fill in the schema's ``default`` values where a field is absent, as the server does."""
    if isinstance(node, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, sub in props.items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                _default(node[key], sub)
        if isinstance(extra, dict):
            for value in node.values():
                _default(value, extra)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for item in node:
            _default(item, schema["items"])


def webhook_violations(job: dict) -> list[str]:
    """The training operator v1.9.4's validating webhook rules for a PyTorchJob."""
    out = []
    name = job["metadata"].get("name", "")
    if len(name) > 63 or not _DNS_1035.match(name):
        out.append(f"metadata.name: Invalid value: {name!r}: a DNS-1035 label must consist of lower case alphanumeric characters or '-'")
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        out.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for rtype, replica in replicas.items():
        containers = replica.get("template", {}).get("spec", {}).get("containers") or []
        if not any(c.get("name") == "pytorch" for c in containers):
            out.append(f"spec.pytorchReplicaSpecs[{rtype}].template.spec.containers: Required value: There is no container named pytorch")
    if "Master" in replicas and replicas["Master"].get("replicas", 1) != 1:
        out.append("spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1")
    elastic = spec.get("elasticPolicy")
    if elastic is not None and "Worker" not in replicas:
        out.append("spec.elasticPolicy: Forbidden: must be configured with a Worker replica spec")
    if elastic and elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
        out.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    return out


# ------------------------------------------------------------------ label selectors
_REQUIREMENT = re.compile(
    r"\s*(?P<neg>!)?(?P<key>[A-Za-z0-9./_-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9._-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` match a label selector string (the API's syntax).

    Raises:
        ApiError: 400 for a selector that does not parse.
    """
    for part in _split_selector(selector):
        m = _REQUIREMENT.match(part)
        if not m or (m["neg"] and (m["op"] or m["setop"])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        key, present = m["key"], m["key"] in labels
        if m["op"] in ("=", "=="):
            ok = labels.get(key) == m["value"]
        elif m["op"] == "!=":
            ok = labels.get(key) != m["value"]
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            ok = labels.get(key) in values if m["setop"] == "in" else labels.get(key) not in values
        else:
            ok = not present if m["neg"] else present
        if not ok:
            return False
    return True


def _split_selector(selector: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, ch in enumerate(selector):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            yield selector[start:i]
            start = i + 1
    if selector[start:].strip():
        yield selector[start:]


# ------------------------------------------------------------------ RBAC
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
        self.rules: dict[str, list[dict]] = {}
        for binding in (d for d in docs if d["kind"] == "RoleBinding"):
            for subject in binding["subjects"]:
                user = f"system:serviceaccount:{subject.get('namespace', namespace)}:{subject['name']}"
                self.rules.setdefault(user, []).extend(roles[binding["roleRef"]["name"]])

    def allows(self, req: Request) -> bool:
        """Whether the request is granted (the admin always is)."""
        if req.user == ADMIN:
            return True
        if req.namespace != self.namespace:
            return False
        return any(
            _has(rule["apiGroups"], req.group)
            and _has(rule["resources"], req.resource)
            and _has(rule["verbs"], req.verb)
            and (not rule.get("resourceNames") or req.name in rule["resourceNames"])
            for rule in self.rules.get(req.user, [])
        )


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the server parses it (Go's ParseBool: the Python client sends ``True``)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _has(allowed: list[str], value: str) -> bool:
    return "*" in allowed or value in allowed


def forbidden(req: Request) -> ApiError:
    """``403 Forbidden`` worded like the real RBAC authorizer's refusal."""
    what = f'{_qualified(req.resource.split("/")[0])} "{req.name}"' if req.name else _qualified(req.resource.split("/")[0])
    sub = req.resource.split("/", 1)[1] if "/" in req.resource else ""
    resource = req.resource.split("/")[0]
    message = (
        f'{what} is forbidden: User "{req.user}" cannot {req.verb} resource "{resource}"'
        + (f' with subresource "{sub}"' if sub else "")
        + f' in API group "{req.group}" in the namespace "{req.namespace}"'
    )
    return ApiError(403, "Forbidden", message, {"name": req.name, "group": req.group, "kind": resource} if req.name else None)


# ------------------------------------------------------------------ the store
@dataclass
class Store:
    """Every object of the cluster, by (resource, namespace, name); one lock for all of it.

    The operator and the kubelet (``trainer.emulation.operator``) work on the same objects under
    the same lock, as controllers work on the API server's state.
    """

    lock: threading.RLock = field(default_factory=threading.RLock)
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        """The stored object (not a copy: callers hold the lock while they use it)."""
        return self.objects.get((resource, namespace, name))

    def items(self, resource: str, namespace: str | None = None) -> list[dict]:
        """The stored objects of a resource, in one namespace or all, by name."""
        keys = sorted(k for k in self.objects if k[0] == resource and (namespace is None or k[1] == namespace))
        return [self.objects[k] for k in keys]

    def put(self, resource: str, obj: dict) -> dict:
        """Store (or replace) ``obj`` under a new resourceVersion."""
        meta = obj["metadata"]
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[(resource, meta["namespace"], meta["name"])] = obj
        return obj

    def touch(self, obj: dict) -> None:
        """Give an object changed in place a new resourceVersion."""
        obj["metadata"]["resourceVersion"] = str(next(self._versions))

    def remove(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object for good (the API then answers 404)."""
        self.objects.pop((resource, namespace, name), None)

    def version(self) -> str:
        """A resourceVersion for a list response."""
        return str(next(self._versions))


def new_metadata(meta: dict, namespace: str) -> dict:
    """Metadata of a newly created object: the client's fields plus the server's own."""
    out = {k: copy.deepcopy(v) for k, v in meta.items() if k in _META_FIELDS}
    out.update(namespace=namespace, uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_rfc3339())
    return out


# ------------------------------------------------------------------ the HTTP server
Route = tuple[str, str, str, str, str]  # group, resource, namespace, name, subresource
_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z0-9.-]+)/(?P<version>v[0-9a-z]+))/namespaces/(?P<ns>[^/]+)/(?P<resource>[a-z]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?)?$"
)
_SERVED = {("", "pods"), (GROUP, PLURAL)}
_SUBRESOURCES = {("", "pods", "log"), ("", "pods", "status"), (GROUP, PLURAL, "status")}


@dataclass(frozen=True, slots=True)
class Audited:
    """One request as the audit log keeps it."""

    user: str
    verb: str
    resource: str
    namespace: str
    name: str
    code: int


class ApiServer:
    """The HTTP front of the emulated cluster; ``handlers`` supplies what happens on each verb."""

    def __init__(self, store: Store, rbac: Rbac, tokens: dict[str, str], handlers: Handlers) -> None:
        self.store, self.rbac, self.tokens, self.handlers = store, rbac, tokens, handlers
        self.audit: list[Audited] = []
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # log streams are chunked

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                server._serve(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                server._serve(self, "POST")

            def do_DELETE(self) -> None:  # noqa: N802
                server._serve(self, "DELETE")

            def do_PUT(self) -> None:  # noqa: N802
                server._serve(self, "PUT")

            def do_PATCH(self) -> None:  # noqa: N802
                server._serve(self, "PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="apiserver", daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving; open log streams end."""
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        user = self.tokens.get((h.headers.get("Authorization") or "").removeprefix("Bearer ").strip(), "")
        req: Request | None = None
        try:
            if not user:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            m = _PATH.match(url.path)
            if not m:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            group, resource, ns, name, sub = m["group"] or "", m["resource"], m["ns"], m["name"] or "", m["sub"] or ""
            if (group, resource) not in _SERVED or (sub and (group, resource, sub) not in _SUBRESOURCES):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
                ("get" if name else "watch" if _flag(query.get("watch")) else "list")
                if method == "GET"
                else ("delete" if name else "deletecollection")
            )
            req = Request(user, verb, group, f"{resource}/{sub}" if sub else resource, ns, name)
            if not self.rbac.allows(req):
                raise forbidden(req)
            body = json.loads(raw) if raw else None
            if req.resource == "pods/log":
                self._audit(req, 200)
                self._stream_log(h, ns, name, query)
                return
            code, out, headers = self.handlers.handle(req, query, body)
            self._audit(req, code)
            self._send(h, code, out, headers)
        except ApiError as e:
            if req is not None:
                self._audit(req, e.code)
            self._send(h, e.code, e.status())
        except json.JSONDecodeError as e:
            self._send(h, 400, ApiError(400, "BadRequest", f"the body of the request could not be decoded: {e}").status())

    def _audit(self, req: Request, code: int) -> None:
        self.audit.append(Audited(req.user, req.verb, req.resource, req.namespace, req.name, code))

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(data)

    def _stream_log(self, h: BaseHTTPRequestHandler, ns: str, name: str, query: dict[str, str]) -> None:
        """A container's log: all of it, or (``follow``) as it grows until the container ends."""
        log, running = self.handlers.log_source(ns, name, query.get("container", ""), previous=_flag(query.get("previous")))
        follow = _flag(query.get("follow"))
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        if not follow:
            data = log.read_bytes()
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            with open(log, "rb") as f:  # the kubelet opens it before the container starts
                while True:
                    alive = running()  # read before the bytes: what the container wrote before it ended is sent
                    if data := f.read():
                        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        h.wfile.flush()
                    if not alive or self.stopping.is_set():
                        break
                    time.sleep(0.2)
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client stopped following
            pass


class Handlers:
    """What the verbs do to the store (the operator module supplies the pod side)."""

    def __init__(
        self,
        store: Store,
        schema: CrdSchema,
        *,
        delete_pod: Callable[[dict, int | None], None],
        log_source: Callable[..., tuple[Path, Callable[[], bool]]],
    ) -> None:
        self.store, self.schema, self.delete_pod, self.log_source = store, schema, delete_pod, log_source

    def handle(self, req: Request, query: dict[str, str], body: dict | None) -> tuple[int, object, dict[str, str]]:
        """Answer one authorized request: (code, body, extra headers)."""
        resource, sub = (req.resource.split("/") + [""])[:2]
        with self.store.lock:
            if req.verb == "create" and resource == PLURAL and not sub:
                return self._create_job(req.namespace, body or {}, query.get("fieldValidation", "Warn"))
            if req.verb == "get":
                obj = self.store.get(resource, req.namespace, req.name)
                if obj is None:
                    raise not_found(resource, req.name)
                return 200, obj, {}
            if req.verb == "list":
                selector = query.get("labelSelector", "")
                if query.get("fieldSelector"):
                    raise ApiError(400, "BadRequest", f"field selectors are not emulated: {query['fieldSelector']!r}")
                items = [
                    o for o in self.store.items(resource, req.namespace) if selector_matches(selector, o["metadata"].get("labels") or {})
                ]
                kind = "PodList" if resource == "pods" else f"{KIND}List"
                api_version = "v1" if resource == "pods" else f"{GROUP}/{VERSION}"
                return (
                    200,
                    {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": self.store.version()}, "items": items},
                    {},
                )
            if req.verb == "delete" and not sub:
                return self._delete(resource, req.namespace, req.name, body or {}, query)
        raise ApiError(405, "MethodNotAllowed", f"{req.verb} on {req.resource} is not emulated")

    def _create_job(self, namespace: str, body: dict, field_validation: str) -> tuple[int, object, dict[str, str]]:
        if field_validation not in ("Ignore", "Warn", "Strict"):
            raise ApiError(400, "BadRequest", f"invalid fieldValidation {field_validation!r}: must be Ignore, Warn or Strict")
        if body.get("apiVersion") != f"{GROUP}/{VERSION}" or body.get("kind") != KIND:
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({body.get('apiVersion')}) does not match the expected API version ({GROUP}/{VERSION})",
            )
        obj = copy.deepcopy(body)
        meta = obj.get("metadata") or {}
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        name = meta.get("name", "")
        if not name or len(name) > 253 or not _DNS_1123_SUBDOMAIN.match(name):
            raise ApiError(
                422,
                "Invalid",
                f'{KIND}.{GROUP} "{name}" is invalid: metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain is required',
            )
        warnings = self.schema.admit(obj, field_validation=field_validation)
        warnings += [f'unknown field "metadata.{k}"' for k in meta if k not in _META_FIELDS | _SERVER_META]
        if violations := webhook_violations(obj):
            raise ApiError(
                422,
                "Invalid",
                f'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied the request: '
                f'{KIND}.{GROUP} "{name}" is invalid: ' + ", ".join(violations),
            )
        if self.store.get(PLURAL, namespace, name) is not None:
            raise ApiError(
                409, "AlreadyExists", f'{PLURAL}.{GROUP} "{name}" already exists', {"name": name, "group": GROUP, "kind": PLURAL}
            )
        obj["metadata"] = new_metadata(meta, namespace)
        obj.pop("status", None)  # the status subresource: only the operator writes it
        stored = self.store.put(PLURAL, obj)
        headers = {"Warning": ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)} if warnings else {}
        return 201, stored, headers

    def _delete(self, resource: str, namespace: str, name: str, body: dict, query: dict[str, str]) -> tuple[int, object, dict[str, str]]:
        obj = self.store.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        policy = body.get("propagationPolicy") or query.get("propagationPolicy") or "Background"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise ApiError(400, "BadRequest", f"propagationPolicy {policy!r} is not one of Background, Foreground, Orphan")
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        meta = obj["metadata"]
        if resource == "pods":
            self.delete_pod(obj, None if grace is None else int(grace))
            return 200, obj, {}
        # A PyTorchJob has no graceful deletion of its own: Background and Orphan remove it at
        # once (the garbage collector then deletes or keeps its pods); Foreground keeps it,
        # with a deletionTimestamp and the foregroundDeletion finalizer, until its pods are gone.
        meta.setdefault("deletionTimestamp", now_rfc3339())
        meta["deletionGracePeriodSeconds"] = 0
        if policy == "Foreground":
            meta["finalizers"] = sorted({*(meta.get("finalizers") or []), "foregroundDeletion"})
            self.store.touch(obj)
            return 200, obj, {}
        if policy == "Orphan":
            for pod in self.store.items("pods", namespace):
                refs = pod["metadata"].get("ownerReferences") or []
                pod["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != meta["uid"]]
        self.store.remove(resource, namespace, name)
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        status["details"] = {"name": name, "group": GROUP, "kind": resource, "uid": meta["uid"]}
        return 200, status, {}
