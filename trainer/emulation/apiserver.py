"""The API-server half of the emulated cluster (``trainer.emulation.cluster``).

A kube-apiserver on loopback, over https with the cluster's own CA (``trainer.emulation.tls``),
for the calls the train step's kubernetes path makes and for a platform engineer's ``kubectl``:
PyTorchJobs (``kubeflow.org/v1``: create, get, list, watch, merge patch, delete), pods (get, list,
watch, delete, ``log`` with ``follow=true``), Nodes (get, list, watch, delete: a node lost),
core/v1 Events and the access reviews. It does what the real server does with them:

- **authentication**: a bearer token of the kubeconfigs, over TLS only; the admin may impersonate
  (``kubectl --as``);
- **discovery and OpenAPI v3** (``trainer.emulation.discovery``), ``/version``;
- **admission** (``trainer.emulation.admission``): the vendored CRD's structural schema (unknown
  fields pruned with a ``Warning`` header, or refused under ``?fieldValidation=Strict``; defaults;
  ``422 Invalid``), then the training operator's validating webhook rules;
- **storage** (``trainer.emulation.api``): ``409 AlreadyExists``, server-set uid,
  resourceVersion, generation, creationTimestamp; ``status`` is the operator's alone;
- **deletion** honours ``propagationPolicy`` (Background, Foreground, Orphan); pods are deleted
  gracefully (``deletionTimestamp``, SIGTERM, ``terminationGracePeriodSeconds``, SIGKILL, gone);
- **label and field selectors**, namespaces, Tables for ``kubectl get`` (``trainer.emulation.tables``);
- **watches** from a resourceVersion (``ERROR`` ``410 Expired`` when it is too old);
- **RBAC** (``trainer.emulation.rbac``): every request is authorized against ``deploy/rbac.yaml``;
  refusals are ``403 Forbidden`` Status objects worded like the real ones;
- every error is a ``Status`` object with the real reason and code; a handler that fails is a
  ``500 InternalError`` Status, and the server keeps serving.

Nothing here imports a Kubernetes client: the tests drive it with the real ones.
"""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

from trainer.emulation.admission import CrdSchema, webhook_violations
from trainer.emulation.api import (
    ADMIN,
    CRD_FILE,
    GROUP,
    KIND,
    PLURAL,
    RBAC_FILE,
    VERSION,
    ApiError,
    Store,
    field_matches,
    flag,
    new_metadata,
    not_found,
    now_rfc3339,
    selector_matches,
)
from trainer.emulation.discovery import Discovery
from trainer.emulation.handlers import Handlers
from trainer.emulation.rbac import PROTOBUF, Rbac, Request, forbidden, review_from_protobuf
from trainer.emulation.tables import wants_table

__all__ = [  # what the cluster, the operator and the tests import from here
    "ADMIN",
    "CRD_FILE",
    "GROUP",
    "KIND",
    "PLURAL",
    "RBAC_FILE",
    "VERSION",
    "ApiError",
    "ApiServer",
    "Audited",
    "CrdSchema",
    "Handlers",
    "Rbac",
    "Request",
    "Store",
    "new_metadata",
    "not_found",
    "now_rfc3339",
    "selector_matches",
    "webhook_violations",
]

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[a-z0-9.-]+)/(?P<version>v[0-9a-z]+))(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[a-z]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?)?$"
)
_HEALTH = ("/healthz", "/livez", "/readyz")


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
    """The HTTPS front of the emulated cluster; ``handlers`` supplies what happens on each verb."""

    def __init__(
        self, store: Store, rbac: Rbac, tokens: dict[str, str], handlers: Handlers, tls: ssl.SSLContext
    ) -> None:
        self.store, self.rbac, self.tokens, self.handlers = store, rbac, tokens, handlers
        self.audit: list[Audited] = []
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # log streams and watches are chunked

            def setup(self) -> None:
                self.request.settimeout(30)  # a client that never finishes its TLS handshake
                self.request.do_handshake()
                self.request.settimeout(None)
                super().setup()

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

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                if not isinstance(sys.exc_info()[1], OSError):  # a client gone or not speaking TLS is not news
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"https://{self.address}"
        self.discovery = Discovery(handlers.schema, self.address)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="apiserver", daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving; open log streams and watches end."""
        self.stopping.set()
        with self.store.changed:
            self.store.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------ one request
    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        h.sent = False  # type: ignore[attr-defined]
        try:
            self._dispatch(h, method)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
            h.close_connection = True
        except Exception as e:  # a bug of the emulator: the client gets a 500 Status, the server goes on
            traceback.print_exc()
            if h.sent:  # type: ignore[attr-defined]
                h.close_connection = True
                return
            error = ApiError(
                500,
                "InternalError",
                f"an error on the server ({type(e).__name__}: {e}) has prevented the request from succeeding",
            )
            with contextlib.suppress(OSError):
                self._send(h, 500, error.status())

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        user = self.tokens.get((h.headers.get("Authorization") or "").removeprefix("Bearer ").strip(), "")
        accept = h.headers.get("Accept") or ""
        req: Request | None = None
        try:
            if not user:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            if who := h.headers.get("Impersonate-User"):
                if user != ADMIN:
                    what = f'User "{user}" cannot impersonate resource "users" in API group "" at the cluster scope'
                    raise ApiError(403, "Forbidden", f'users "{who}" is forbidden: {what}')
                user = who
            path = unquote(url.path)
            if path.rstrip("/") in _HEALTH:
                self._send_raw(h, 200, b"ok", "text/plain; charset=utf-8")
                return
            if method == "GET" and (found := self.discovery.document(path, accept)) is not None:
                self._send(h, 200, found[0], content_type=found[1])
                return
            m = _PATH.match(path)
            if not m:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            group, resource, ns, name, sub = (
                m["group"] or "",
                m["resource"],
                m["ns"] or "",
                m["name"] or "",
                m["sub"] or "",
            )
            served = self.discovery.find(group, resource)
            if (
                served is None
                or served.version != (m["version"] or "v1")
                or (sub and sub not in served.subresources)
                or (served.namespaced and name and not ns)
                or (not served.namespaced and ns)
            ):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
                ("get" if name else "watch" if flag(query.get("watch")) else "list")
                if method == "GET"
                else ("delete" if name else "deletecollection")
            )
            req = Request(user, verb, group, f"{resource}/{sub}" if sub else resource, ns, name)
            if not self.rbac.allows(req):
                raise forbidden(req)
            body = self._body(raw, h.headers.get("Content-Type") or "application/json")
            if body is not None and not isinstance(body, dict) and verb != "patch":
                raise ApiError(
                    400, "BadRequest", f"the body of the request must be an object, not {type(body).__name__}"
                )
            if req.resource == "pods/log":
                self._audit(req, 200)
                self._stream_log(h, ns, name, query)
                return
            if verb == "watch":
                self._audit(req, 200)
                self._watch(h, resource, ns, query, accept)
                return
            code, out, headers = self.handlers.handle(
                req, query, body, accept=accept, content_type=h.headers.get("Content-Type") or ""
            )
            self._audit(req, code)
            self._send(h, code, out, headers)
        except ApiError as e:
            if req is not None:
                self._audit(req, e.code)
            self._send(h, e.code, e.status())

    @staticmethod
    def _body(raw: bytes, content_type: str) -> object:
        if not raw:
            return None
        if content_type.split(";")[0].strip() == PROTOBUF:
            return review_from_protobuf(raw)
        try:
            if "yaml" in content_type:
                import yaml

                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "BadRequest", f"the body of the request could not be decoded: {e}") from e
        except Exception as e:  # yaml's errors
            raise ApiError(400, "BadRequest", f"the body of the request could not be decoded: {e}") from e

    def _audit(self, req: Request, code: int) -> None:
        self.audit.append(Audited(req.user, req.verb, req.resource, req.namespace, req.name, code))

    def _send(
        self,
        h: BaseHTTPRequestHandler,
        code: int,
        body: object,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self._send_raw(h, code, json.dumps(body).encode(), content_type, headers)

    @staticmethod
    def _send_raw(
        h: BaseHTTPRequestHandler, code: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        h.sent = True  # type: ignore[attr-defined]
        h.send_response(code)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _start_stream(h: BaseHTTPRequestHandler, content_type: str) -> None:
        h.sent = True  # type: ignore[attr-defined]
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    # ------------------------------------------------------------ streams
    def _watch(
        self, h: BaseHTTPRequestHandler, resource: str, namespace: str, query: dict[str, str], accept: str
    ) -> None:
        """Stream the changes of a resource from a resourceVersion, as watch events (one JSON
        object a line); a version no longer kept is an ``ERROR`` event with ``410 Expired``.
        """
        version_text = query.get("resourceVersion", "")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds", "").isdigit() else 1800.0
        deadline = time.monotonic() + timeout
        table = wants_table(accept)
        first = True

        def event(kind: str, obj: dict) -> bytes:
            nonlocal first
            if table:
                obj = self.handlers.render(resource, [obj], query, accept, headers=first)
            first = False
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        with self.store.lock:
            # Bad selectors are refused before the stream starts, as the real server does.
            selector_matches(query.get("labelSelector", ""), {})
            field_matches(query.get("fieldSelector", ""), resource, {})
            if version_text in ("", "0"):
                last = int(self.store.version())
                pending = [
                    event("ADDED", o)
                    for o in self.store.items(resource, namespace or None)
                    if self.handlers.matches(resource, namespace, query, o)
                ]
            else:
                try:
                    last = int(version_text)
                except ValueError:
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {version_text!r}") from None
                pending = []
        self._start_stream(h, "application/json")
        try:
            while True:
                for data in pending:
                    self._chunk(h, data)
                if self.stopping.is_set() or time.monotonic() >= deadline:
                    break
                with self.store.changed:
                    try:
                        changes = self.store.since(last)
                    except ApiError as e:
                        self._chunk(h, json.dumps({"type": "ERROR", "object": e.status()}).encode() + b"\n")
                        break
                    if not changes:
                        self.store.changed.wait(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
                        pending = []
                        continue
                    last = changes[-1].version
                    pending = [
                        event(c.type, c.object)
                        for c in changes
                        if c.resource == resource and self.handlers.matches(resource, namespace, query, c.object)
                    ]
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):  # the client stopped watching
            h.close_connection = True

    def _stream_log(self, h: BaseHTTPRequestHandler, ns: str, name: str, query: dict[str, str]) -> None:
        """A container's log: all of it (or its last ``tailLines``), or (``follow``) as it grows
        until the container ends.
        """
        log, running = self.handlers.log_source(
            ns, name, query.get("container", ""), previous=flag(query.get("previous"))
        )
        follow = flag(query.get("follow"))
        tail = int(query["tailLines"]) if query.get("tailLines", "").lstrip("-").isdigit() else None
        if not follow:
            data = log.read_bytes()
            self._send_raw(h, 200, _tail(data, tail), "text/plain")
            return
        self._start_stream(h, "text/plain")
        try:
            with open(log, "rb") as f:  # the kubelet opens it before the container starts
                first = True
                while True:
                    alive = running()  # read before the bytes: what the container wrote before it ended is sent
                    data = f.read()
                    if first:
                        data, first = _tail(data, tail), False
                    if data:
                        self._chunk(h, data)
                    if not alive or self.stopping.is_set():
                        break
                    time.sleep(0.2)
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):  # the client stopped following
            h.close_connection = True


def _tail(data: bytes, lines: int | None) -> bytes:
    if lines is None or lines < 0:
        return data
    if lines == 0:
        return b""
    return b"".join(data.splitlines(keepends=True)[-lines:])
