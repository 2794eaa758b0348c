"""What the emulated kubelet makes of API objects: a container's launch spec (its mounts, hosts,
environment and argv, as ``trainer.emulation.container`` takes it) and the Node it registers.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from trainer.emulation.api import ApiError, now_rfc3339

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
KUBELET_VERSION = "v1.32.0-emulated"


def container_spec(
    pod: dict,
    container: dict,
    *,
    pod_dir: Path,
    claims: dict[str, Path],
    secrets: dict[tuple[str, str], dict[str, str]],
    network: Callable[[], str],
    peers: Callable[[], list[dict]],
) -> dict:
    """What ``trainer.emulation.container`` needs to run ``container`` of ``pod``: network, mounts,
    hosts, env, argv. ``network`` and ``peers`` are asked last, once the spec is known to be valid.

    Raises:
        ApiError: a volume, secret or entrypoint the pod names that is not there or not emulated.
    """
    meta, spec = pod["metadata"], pod["spec"]
    ns = meta["namespace"]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = []
    memory: dict[str, int | None] = {}  # the sandbox's tmpfs folders
    for vm in container.get("volumeMounts") or []:
        volume = volumes[vm["name"]]
        mount = {"target": vm["mountPath"], "readOnly": vm.get("readOnly", False)}
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in claims:
                raise ApiError(400, "Unschedulable", f'persistentvolumeclaim "{claim}" not found')
            mount.update(kind="bind", source=str(claims[claim] / vm.get("subPath", "")))
        elif "emptyDir" in volume:
            source = pod_dir / "volumes" / vm["name"]
            source.mkdir(parents=True, exist_ok=True)
            mount.update(kind="bind", source=str(source))
            if volume["emptyDir"].get("medium") == "Memory":  # a tmpfs there, in the pod's sandbox
                memory[str(source)] = quantity_bytes(volume["emptyDir"].get("sizeLimit"))
        elif "secret" in volume:
            name = volume["secret"]["secretName"]
            data = secrets.get((ns, name))
            if data is None and not volume["secret"].get("optional"):
                raise ApiError(400, "FailedMount", f'secret "{name}" not found')
            source = pod_dir / "volumes" / vm["name"]
            source.mkdir(parents=True, exist_ok=True)
            for key, value in (data or {}).items():
                (source / key).write_text(value)
            mount.update(kind="bind", source=str(source), readOnly=True)
        else:
            raise ApiError(
                400,
                "FailedMount",
                f"volume {vm['name']}: only persistentVolumeClaim, emptyDir and secret volumes are emulated",
            )
        mounts.append(mount)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(pod_dir),
    }
    env["HOSTNAME"] = meta["name"]
    for source in container.get("envFrom") or []:
        ref = source.get("secretRef")
        if ref is None:
            raise ApiError(400, "CreateContainerConfigError", "only secretRef is emulated in envFrom")
        data = secrets.get((ns, ref["name"]))
        if data is None and not ref.get("optional"):
            raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" not found')
        env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
    for var in container.get("env") or []:
        env[var["name"]] = env_value(pod, var, env, secrets)
    argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise ApiError(400, "CreateContainerError", "the emulated image has no entrypoint: set the container's command")
    hosts = pod_dir / "hosts"
    hosts.write_text(
        "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
        + "".join(f"{p['status']['podIP']}\t{p['metadata']['name']}\n" for p in peers())
    )
    return {
        "netns": network(),
        "memory": memory,
        "hostname": meta["name"],
        "hosts": str(hosts),
        "mounts": mounts,
        "env": env,
        "argv": argv,
        "cwd": container.get("workingDir") or str(pod_dir),
    }


def env_value(pod: dict, var: dict, env: dict[str, str], secrets: dict[tuple[str, str], dict[str, str]]) -> str:
    """The value of the container's env entry ``var``: a value, a field of the pod or a secret's key."""
    if "valueFrom" not in var:
        return expand(var.get("value", ""), env)
    source = var["valueFrom"]
    if "fieldRef" in source:
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "status.podIP": pod["status"]["podIP"],
        }
        return fields[source["fieldRef"]["fieldPath"]]
    ref = source.get("secretKeyRef")
    if ref is None:
        raise ApiError(
            400,
            "CreateContainerConfigError",
            f"env {var['name']}: only value, fieldRef and secretKeyRef are emulated",
        )
    data = secrets.get((pod["metadata"]["namespace"], ref["name"])) or {}
    if ref["key"] not in data and not ref.get("optional"):
        raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" has no key {ref["key"]}')
    return data.get(ref["key"], "")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` escapes; an unknown reference stays as written)."""
    return _VAR_REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def quantity_bytes(quantity: str | None) -> int | None:
    """A Kubernetes quantity (``512Mi``, ``2G``) in bytes (None: none given, or not one)."""
    if not quantity:
        return None
    m = _QUANTITY.match(quantity)
    return int(float(m[1]) * _UNITS[m[2] or ""]) if m else None


def node_object(name: str) -> dict:
    """A Ready Node as a kubelet registers it (this machine's OS, kernel and architecture)."""
    os_image = "Linux"
    with contextlib.suppress(OSError):
        release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
        os_image = release.get("PRETTY_NAME", os_image).strip('"')
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    capacity = {"cpu": str(os.cpu_count() or 1), "memory": f"{memory // 1024}Ki", "pods": "110"}
    now = now_rfc3339()
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch,
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": arch,
    }
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}
    ready.update(lastHeartbeatTime=now, lastTransitionTime=now)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now, "labels": labels},
        "spec": {},
        "status": {
            "conditions": [ready],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "capacity": dict(capacity),
            "allocatable": dict(capacity),
            "nodeInfo": {
                "kubeletVersion": KUBELET_VERSION,
                "containerRuntimeVersion": "emulated://1.0",
                "osImage": os_image,
                "kernelVersion": os.uname().release,
                "operatingSystem": "linux",
                "architecture": arch,
            },
        },
    }
