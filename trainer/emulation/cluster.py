"""A Kubernetes cluster with the training operator, emulated on this machine (root).

The train step's kubernetes path (``trainer.launch.k8s``) runs against it unchanged, through a
kubeconfig: the real ``kubeflow-training`` and ``kubernetes`` clients (and ``kubectl``) talk to an
API server on loopback, over https with a CA made for this cluster (``trainer.emulation.apiserver``,
``trainer.emulation.tls``), an operator emulator turns the stored PyTorchJob into Worker pods and
a kubelet runs each pod's container as local processes (``trainer.emulation.operator``,
``trainer.emulation.kubelet``, ``trainer.emulation.container``)::

    with emulated_cluster(Path("work/cluster"), claims={"rfsdp-workspace": Path("work/pvc")}) as cluster:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)   # the step's service account
        run_pytorchjob(job)                                    # trainer.launch.k8s

The kubeconfig authenticates as the ServiceAccount of ``deploy/rbac.yaml`` in ``namespace``,
whose Role is all it may use; ``admin_kubeconfig`` may do anything (tests, ``kubectl``).
docs/emulation.md says what is emulated and what is not.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainer.emulation.admission import CrdSchema
from trainer.emulation.api import ADMIN, Store
from trainer.emulation.apiserver import ApiServer, Audited
from trainer.emulation.handlers import Handlers
from trainer.emulation.operator import Controllers
from trainer.emulation.rbac import Rbac
from trainer.emulation.tls import make_pki


def cluster_problem() -> str | None:
    """Why this process cannot run the emulated cluster (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (each pod gets mount, UTS and network namespaces, its volumes are mounts)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (util-linux / iproute2)"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--net", "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create namespaces: {probe.stderr.strip() or probe.returncode}"
    return None


@dataclass(frozen=True)
class Cluster:
    """A running emulated cluster."""

    url: str
    """The API server (``https://127.0.0.1:PORT``; its CA is in the kubeconfigs and ``ca``)."""
    namespace: str
    """The namespace ``deploy/rbac.yaml`` is applied in (the kubeconfig's namespace)."""
    kubeconfig: Path
    """Credentials of the ServiceAccount of ``deploy/rbac.yaml`` (what the train step uses)."""
    admin_kubeconfig: Path
    """Credentials that may do anything (tests and ``kubectl``)."""
    service_account: str
    """The user the kubeconfig authenticates as (``system:serviceaccount:NS:NAME``)."""
    store: Store
    """Every object of the cluster (hold ``store.lock`` while reading it)."""
    audit: list[Audited]
    """Every request the API server answered, in order."""
    ca: Path
    """The cluster's CA certificate (PEM), which signed the API server's."""

    def stored(self, resource: str, namespace: str, name: str) -> dict | None:
        """A copy of a stored object (None when there is none)."""
        with self.store.lock:
            obj = self.store.get(resource, namespace, name)
            return copy.deepcopy(obj) if obj is not None else None


@contextlib.contextmanager
def emulated_cluster(
    root: Path,
    *,
    namespace: str = "default",
    claims: Mapping[str, Path] | None = None,
    secrets_data: Mapping[str, Mapping[str, str]] | None = None,
    restart_backoff_s: float = 10.0,
    kubelet: bool = True,
    nodes: int = 4,
) -> Iterator[Cluster]:
    """Start an emulated cluster; everything it started is stopped on exit (pods get SIGTERM,
    then SIGKILL after 10 s).

    Args:
        root: working directory (kubeconfigs, pod logs, per-pod volumes).
        namespace: where ``deploy/rbac.yaml`` is applied and the kubeconfig points.
        claims: PersistentVolumeClaim name -> local directory (a pod whose claim is missing
            stays Pending, as on a cluster).
        secrets_data: Secrets in ``namespace``: name -> key -> value.
        restart_backoff_s: the kubelet's first crash-loop back-off (10 s on a real node).
        kubelet: False: no pod is ever started (they stay Pending, as on a cluster without
            nodes): the API server and the operator alone, which need no root.
        nodes: how many Nodes the cluster has (``emulated-node-0`` ...; each pod goes to the one
            that runs the fewest). ``kubectl delete node`` loses one: see ``trainer.emulation.kubelet``.

    Raises:
        RuntimeError: this machine cannot run it (:func:`cluster_problem` says why).
    """
    if kubelet and (problem := cluster_problem()):
        raise RuntimeError(f"the emulated cluster {problem}")
    root.mkdir(parents=True, exist_ok=True)
    store = Store()
    rbac = Rbac(namespace)
    user = f"system:serviceaccount:{namespace}:{rbac.service_accounts[0]}"
    tokens = {secrets.token_hex(16): user, secrets.token_hex(16): ADMIN}
    controllers = Controllers(
        store,
        root,
        {name: Path(path).resolve() for name, path in (claims or {}).items()},
        {(namespace, name): dict(data) for name, data in (secrets_data or {}).items()},
        restart_backoff_s,
        kubelet=kubelet,
        nodes=nodes,
    )
    handlers = Handlers(
        store, CrdSchema(), delete_pod=controllers.delete_pod, log_source=controllers.log_source, rbac=rbac
    )
    pki = make_pki(root / "pki")
    server = ApiServer(store, rbac, tokens, handlers, pki.server_context())
    token_of = {who: token for token, who in tokens.items()}
    ca = pki.ca.read_bytes()
    cluster = Cluster(
        url=server.url,
        namespace=namespace,
        kubeconfig=_write_kubeconfig(root / "kubeconfig", server.url, ca, namespace, user, token_of[user]),
        admin_kubeconfig=_write_kubeconfig(
            root / "admin.kubeconfig", server.url, ca, namespace, ADMIN, token_of[ADMIN]
        ),
        service_account=user,
        store=store,
        audit=server.audit,
        ca=pki.ca,
    )
    loop = threading.Thread(target=controllers.run, name="controllers", daemon=True)
    server.start()
    loop.start()
    try:
        yield cluster
    finally:
        server.stop()
        controllers.stop.set()
        loop.join()


def _write_kubeconfig(path: Path, url: str, ca: bytes, namespace: str, user: str, token: str) -> Path:
    cluster = {"server": url, "certificate-authority-data": base64.b64encode(ca).decode()}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": user, "namespace": namespace}}],
        "current-context": "emulated",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
