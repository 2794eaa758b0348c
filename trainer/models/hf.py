"""Hugging Face causal LMs (``--model hf:PATH``) as a :class:`~trainer.models.spec.ModelSpec`.

PATH is a local directory, an ``s3://`` prefix or a hub id (``org/name``, where the hub is
reachable; ``HF_TOKEN`` is its token), holding a ``config.json`` and optionally weights
(``model.safetensors``, or shards named by ``model.safetensors.index.json``). Any
``AutoModelForCausalLM`` architecture works.

With weights, the model is built with its parameters on the meta device, sharded, and each rank
then reads from the safetensors files only the rows of its own shards: a node holds about one
copy of the weights, not one per rank. Without weights, it starts from the architecture's own
initialization under ``--seed`` (each rank builds it whole, then shards it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from trainer.errors import ParameterError
from trainer.models.spec import causal_lm_loss

PREFIX = "hf:"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
FILES = (CONFIG, "generation_config.json", WEIGHTS_INDEX)  # plus the weight files
DEFAULT_SEQ_LEN = 1024
"""``--seq-len 0`` for an HF model: this, or the model's ``max_position_embeddings`` if shorter."""


def model_dir(path: str, cache: Path | None = None, *, config_only: bool = False) -> Path:
    """A local directory holding the model at ``path`` (the part after ``hf:``).

    An ``s3://`` prefix is downloaded once per node into ``CACHE/<hash>/`` (the first rank
    downloads under a lock, the others wait and reuse it); a hub id is fetched by
    ``huggingface_hub`` into its own cache. ``config_only``: of an ``s3://`` model, only its
    config, into a fresh temporary directory (for the checks before any worker starts).

    Raises:
        ParameterError: naming ``model`` when there is no ``config.json`` there.
    """
    if path.startswith("s3://"):
        return _download(path, cache or Path(tempfile.gettempdir()) / "rfsdp-models", config_only=config_only)
    local = Path(path.removeprefix("file://")).expanduser()
    if local.is_dir():
        if not (local / CONFIG).is_file():
            raise ParameterError("model", f"hf:{path}: no {CONFIG} in that directory")
        return local
    if local.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ParameterError("model", f"hf:{path}: no model directory there")
    return _from_hub(path)


def _download(uri: str, cache: Path, *, config_only: bool = False) -> Path:
    from trainer.storage.store import StorageError, open_storage

    store = open_storage(uri)
    try:
        keys = store.list()
    except StorageError as e:
        raise ParameterError("model", f"hf:{uri}: {e}") from None
    if CONFIG not in keys:
        raise ParameterError("model", f"hf:{uri}: no {CONFIG} under that prefix")
    if config_only:
        dest = Path(tempfile.mkdtemp(prefix="rfsdp-model-config."))
        store.download(CONFIG, dest / CONFIG)
        return dest
    wanted = [k for k in keys if "/" not in k and (k in FILES or k.endswith(".safetensors"))]
    dest = cache / hashlib.sha256(uri.encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank of the node downloads; the others find it done
        if (dest / CONFIG).is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{dest.name}."))
        try:
            for key in sorted(wanted, key=lambda k: k == CONFIG):  # config last: its presence means complete
                store.download(key, tmp / key)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = [CONFIG, "generation_config.json", "*.safetensors", WEIGHTS_INDEX]
        return Path(snapshot_download(repo_id, allow_patterns=patterns, token=os.environ.get("HF_TOKEN") or None))
    except Exception as e:  # offline, unknown repo, no access: all the same to the user
        problem = f"hf:{repo_id}: not a local directory, and the hub cannot give it ({type(e).__name__}: {e})"
        raise ParameterError("model", problem) from None


def load_config(directory: Path):  # -> transformers.PretrainedConfig
    """The model's config, or a :class:`ParameterError` naming ``model`` when transformers cannot build it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as e:
        raise ParameterError(
            "model", f"hf:{directory}: transformers cannot read its {CONFIG} ({type(e).__name__}: {e})"
        ) from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the model at ``directory`` (none: config only)."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [directory / WEIGHTS] if (directory / WEIGHTS).is_file() else []


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the meta device (no memory, no init
    cost); buffers stay real, so those a model computes at build time (rotary frequencies) hold.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    # A parameter is made (torch.empty) before it is moved: deterministic mode would fill every
    # one with NaN first, touching the memory of the whole model.
    fill = torch.utils.deterministic.fill_uninitialized_memory
    nn.Module.register_parameter, torch.utils.deterministic.fill_uninitialized_memory = on_meta, False
    try:
        yield
    finally:
        nn.Module.register_parameter, torch.utils.deterministic.fill_uninitialized_memory = register, fill


class HfModel:
    """An ``AutoModelForCausalLM``, sharded per decoder layer (the classes named by the model's
    ``_no_split_modules``: the layers transformers itself never splits across devices).
    """

    def __init__(self, path: str, *, cache: Path | None = None, meta: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.directory = model_dir(path, cache, config_only=meta)
        self.config = load_config(self.directory)
        self.weights = weight_files(self.directory)
        build = _parameters_on_meta() if self.weights or meta else contextlib.nullcontext()
        try:
            with build:
                self.module = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        except Exception as e:
            raise ParameterError(
                "model", f"hf:{path}: transformers cannot build a causal LM from it ({type(e).__name__}: {e})"
            ) from None
        self.vocab_size = int(self.config.vocab_size)
        self.seq_len = min(
            DEFAULT_SEQ_LEN, int(getattr(self.config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN)
        )

    def fsdp_units(self) -> list[nn.Module]:
        """The decoder layers."""
        names = set(getattr(self.module, "_no_split_modules", None) or ())
        # (by any class in the MRO: once sharded, a layer's class is FSDP's subclass of its own)
        units = [m for m in self.module.modules() if names.intersection(c.__name__ for c in type(m).__mro__)]
        if not units:
            raise ParameterError(
                "model", f"{type(self.module).__name__} names no decoder layer class (_no_split_modules)"
            )
        return units

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the model's logits (the targets are already shifted)."""
        return causal_lm_loss(self.module(input_ids=inputs, use_cache=False).logits, targets)

    def materialize(self, device: torch.device) -> None:
        """Give the meta parameters real memory on ``device`` and read the weights into them:
        for a sharded parameter (a DTensor) only the rows of this rank's shard.
        """
        if not self.weights:
            return
        buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        self.module.to_empty(device=device)
        with torch.no_grad():
            for name, b in self.module.named_buffers():
                b.copy_(buffers[name])
            read_weights(self.module, self.weights)

    def check_weights(self) -> None:
        """Refuse weights that do not fit the config (naming ``model``), from the files' headers."""
        shapes = weight_shapes(self.weights)
        problems = []
        for name, p in self.module.named_parameters():
            if name not in shapes:
                problems.append(f"{name} is missing")
            elif shapes[name] != tuple(p.shape):
                problems.append(f"{name} is {list(shapes[name])} in the weights, {list(p.shape)} in the config")
        if problems:
            shown = "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
            raise ParameterError("model", f"hf:{self.directory}: the weights do not fit its config: {shown}")


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The safetensors dtype names this reader maps."""


def _header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def mapped_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of the file mapped into memory: nothing is
    read until a view's values are, and then only those pages (a private mapping: shared with the
    page cache, never copied unless written).
    """
    header, start = _header(file)
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ParameterError(
                "model", f"{file}: tensor {name} has dtype {info['dtype']}, which this trainer does not read"
            )
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        flat = (
            torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.view(info["shape"])
    return tensors


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers alone."""
    return {name: tuple(info["shape"]) for file in files for name, info in _header(file)[0].items()}


def read_weights(module: nn.Module, files: list[Path]) -> None:
    """Copy each parameter's values from ``files`` (safetensors, mapped): a DTensor gets its
    local rows only, read straight from the mapped file into the shard.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = dict(module.named_parameters())
    for file in files:
        for key, stored in mapped_tensors(file).items():
            param = params.pop(key, None)
            if param is None:
                continue
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                stored = stored[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            else:
                local = param.data
            if local.numel():
                local.copy_(stored)  # (converts the dtype: bf16 weights into fp32 parameters)
    if params:
        raise ParameterError(
            "model", f"the weights lack {', '.join(sorted(params)[:3])}{' and more' if len(params) > 3 else ''}"
        )
