"""Export a run's checkpoint as a model directory other tools load (``rfsdp export``).

An ``hf:`` model becomes a Hugging Face model directory that
``AutoModelForCausalLM.from_pretrained(DIR)`` loads with no project code:

- ``config.json`` (and ``generation_config.json`` where the model had one), copied from the
  model's own directory;
- the weights as safetensors shards ``model-00001-of-0000N.safetensors`` of at most
  ``max_shard_size`` bytes each, named by ``model.safetensors.index.json`` (written for one shard
  too, as transformers writes it for a sharded save), in the dtype of the config's ``dtype`` (or
  ``torch_dtype``), else float32; a tied tensor (``tie_word_embeddings``) is written once;
- the tokenizer's files of the run's data set, when it was prepared with a tokenizer.

A built-in size (``tiny`` ... ``1b``) and a ``py:`` model are written as one ``model.safetensors``
(the module's ``state_dict``, float32) and a ``config.json`` naming the architecture
(``"architecture": "rfsdp-builtin"`` with the size's fields, or ``"rfsdp-py"`` with the factory).

Nothing is written before every input is checked; a local ``--out`` appears whole (written beside
it, then renamed into place), and an ``s3://`` one gets its ``config.json`` last, so that a reader
who sees the config sees the whole model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainer.checkpoint import CHECKPOINTS, published_checkpoints, read_full_state, step_dir_name
from trainer.data.shards import DataError, tokenizer_dir
from trainer.errors import ParameterError
from trainer.models import MODEL_SIZES, build_model
from trainer.results.validate import run_config
from trainer.storage.store import StorageError, is_remote, open_storage, upload_tree

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
BUILTIN_ARCHITECTURE = "rfsdp-builtin"
PY_ARCHITECTURE = "rfsdp-py"
FORMAT_VERSION = 1
"""Version of the ``rfsdp-builtin`` / ``rfsdp-py`` formats (``format_version`` in their config)."""
DEFAULT_MAX_SHARD_SIZE = "2GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export_run` wrote."""

    out: str
    step: int
    kind: str
    """``hf``, ``builtin`` or ``py``."""
    files: list[str]
    tensors: int
    bytes: int
    """Bytes of the weight files."""
    dtype: str
    tokenizer: bool
    """The data set's tokenizer files were written beside the model."""

    def to_dict(self) -> dict:
        """The result as JSON-ready values."""
        return asdict(self)


def parse_size(text: str | int) -> int:
    """``2GB``, ``500MB``, ``1GiB`` or a number of bytes -> bytes (decimal units as transformers reads them).

    Raises:
        ParameterError: naming ``max_shard_size``.
    """
    if isinstance(text, int):
        value, unit = text, ""
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
        if not m or m[2].upper() not in _UNITS:
            raise ParameterError("max_shard_size", f"{text!r} is not a size such as 2GB, 500MB or 1GiB")
        value, unit = int(m[1]), m[2].upper()
    if value <= 0:
        raise ParameterError("max_shard_size", f"must be positive, got {text!r}")
    return value * _UNITS[unit]


def export_run(
    run_dir: Path,
    out: str,
    *,
    step: int | None = None,
    data: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> ExportResult:
    """Write the run's checkpoint at ``step`` (default: the latest published) as a model directory.

    Args:
        run_dir: the training run directory.
        out: a local directory (absent or empty) or an ``s3://`` prefix (empty).
        step: a published checkpoint's step.
        data: the prepared data set, for its tokenizer (default: the one the run recorded).
        max_shard_size: most bytes in one safetensors file of an ``hf:`` model (``2GB``).

    Raises:
        ValueError: a bad input, naming the parameter; nothing was written.
    """
    run_dir = Path(run_dir)
    limit = parse_size(max_shard_size)
    if not run_dir.is_dir():
        raise ParameterError("run_dir", f"{run_dir} does not exist")
    cfg = run_config(run_dir, data)  # (a ValidationError names --run-dir or --data)
    published = dict(published_checkpoints(run_dir / CHECKPOINTS))
    if not published:
        raise ParameterError("run_dir", f"{run_dir} has no published checkpoint (nothing in {run_dir / CHECKPOINTS})")
    step = max(published) if step is None else step
    if step not in published:
        raise ParameterError(
            "step", f"{run_dir} has no published checkpoint {step_dir_name(step)} (published: {sorted(published)})"
        )
    _check_out_empty(out)
    try:
        tokenizer = tokenizer_dir(Path(cfg.data))
    except (DataError, OSError) as e:
        raise ParameterError(
            "data", f"cannot read the run's data set {cfg.data} for its tokenizer ({e}); pass --data DIR"
        ) from None
    model = _ModelFiles(cfg.model, cache=run_dir / "model_cache")  # checked before anything is read or written

    state = read_full_state(published[step], keys={"model"})[
        "model"
    ]  # (the optimizer's state: twice the model, unread)
    weights = model.weights(state)
    with tempfile.TemporaryDirectory(prefix="rfsdp-export-") as tmp:
        staged = Path(tmp) / "model"
        staged.mkdir()
        files, size = model.write(staged, weights, step, limit)
        if tokenizer is not None:
            for f in sorted(tokenizer.iterdir()):
                if f.is_file() and not (staged / f.name).exists():
                    shutil.copyfile(f, staged / f.name)
        names = sorted(p.name for p in staged.iterdir())
        if is_remote(out):
            upload_tree(staged, out, last=CONFIG)  # config last: a reader that sees it sees a whole model
        else:
            _move_into_place(staged, Path(out))
    return ExportResult(
        out=out,
        step=step,
        kind=model.kind,
        files=names,
        tensors=len(weights),
        bytes=size,
        dtype=str(model.dtype).removeprefix("torch."),
        tokenizer=tokenizer is not None,
    )


def _check_out_empty(out: str) -> None:
    if is_remote(out):
        try:
            keys = open_storage(out).list()
        except StorageError as e:
            raise ParameterError("out", str(e)) from None
        if keys:
            raise ParameterError(
                "out", f"{out} is not empty ({len(keys)} object(s), e.g. {keys[0]}): export into an empty prefix"
            )
        return
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ParameterError("out", f"{path} is not an empty directory: export into a new or empty one")


def _move_into_place(staged: Path, out: Path) -> None:
    """Move the whole model to ``out`` at once (a reader never sees it half written)."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        moved = tmp / "model"
        shutil.copytree(staged, moved)  # (the staging folder may be on another file system)
        os.chmod(moved, 0o755)  # (the temporary folders' and safetensors' files are private: 0700, 0600)
        for f in moved.iterdir():
            os.chmod(f, 0o644)
        if out.is_dir():
            out.rmdir()  # empty: checked before
        os.replace(moved, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _ModelFiles:
    """The run's model as the export needs it: its kind, its state dict's names and shapes (built
    on the meta device: no memory), the tied names to leave out, the dtype and the config files.
    """

    def __init__(self, name: str, *, cache: Path) -> None:
        self.name = name
        self.files: dict[str, bytes] = {}
        if name.startswith("hf:"):
            from transformers import AutoModelForCausalLM

            from trainer.models.hf import load_config

            self.kind = "hf"
            directory = _hf_config_dir(name.removeprefix("hf:"), cache)
            config = load_config(directory)
            for file in (CONFIG, GENERATION_CONFIG):
                if (directory / file).is_file():
                    self.files[file] = (directory / file).read_bytes()
            if is_remote(name.removeprefix("hf:")):
                shutil.rmtree(directory, ignore_errors=True)  # (read: only the config files were downloaded)
            self.dtype = _config_dtype(json.loads(self.files[CONFIG]))
            try:
                with torch.device("meta"):
                    module = AutoModelForCausalLM.from_config(config)
            except Exception as e:
                raise ParameterError(
                    "model", f"{name}: transformers cannot build a causal LM from it ({type(e).__name__}: {e})"
                ) from None
        else:
            self.kind = "builtin" if name in MODEL_SIZES else "py"
            self.dtype = torch.float32
            with torch.device("meta"):
                spec = build_model(name)
            module = spec.module
            fields = {"architecture": BUILTIN_ARCHITECTURE, "format_version": FORMAT_VERSION, "model": name}
            if self.kind == "builtin":
                size = MODEL_SIZES[name]
                fields.update(
                    dim=size.dim, layers=size.layers, heads=size.heads, seq_len=size.seq_len, vocab_size=size.vocab_size
                )
            else:
                fields.update(architecture=PY_ARCHITECTURE, factory=name.removeprefix("py:"))
                fields.update(vocab_size=int(spec.vocab_size), seq_len=int(spec.seq_len))
            self.config = fields
        # Names in the module's state_dict order; a tensor reachable under two names (tied
        # embeddings) is kept under the first, as transformers saves it (safetensors refuses aliases).
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.tied: set[str] = set()
        seen: set[int] = set()
        for key, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                self.tied.add(key)
            else:
                seen.add(id(tensor))
                self.shapes[key] = tuple(tensor.shape)

    def weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's model tensors to write: every name of the model once, in its dtype.

        Raises:
            ParameterError: naming ``run_dir``: the checkpoint does not hold this model.
        """
        missing = [k for k in self.shapes if k not in state]
        extra = [k for k in state if k not in self.shapes and k not in self.tied]
        misfit = [
            f"{k} {list(state[k].shape)} vs {list(s)}"
            for k, s in self.shapes.items()
            if k in state and tuple(state[k].shape) != s
        ]
        if missing or extra or misfit:
            problems = [f"lacks {', '.join(missing[:3])}"] if missing else []
            problems += [f"has {', '.join(extra[:3])} the model does not"] if extra else []
            problems += [f"shapes differ: {', '.join(misfit[:3])}"] if misfit else []
            raise ParameterError(
                "run_dir", f"the checkpoint does not hold the run's model {self.name}: it {'; '.join(problems)}"
            )
        out = {}
        for key in self.shapes:
            tensor = state[key]
            if tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            out[key] = tensor.contiguous()
        return out

    def write(self, out: Path, weights: dict[str, torch.Tensor], step: int, limit: int) -> tuple[list[str], int]:
        """Write the weights and the config files into ``out``; returns the weight files and their bytes."""
        from safetensors.torch import save_file

        if self.kind != "hf":
            save_file(weights, out / WEIGHTS, metadata={"format": "pt"})
            config = {**self.config, "dtype": str(self.dtype).removeprefix("torch."), "step": step}
            (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            return [WEIGHTS], (out / WEIGHTS).stat().st_size
        shards: list[dict[str, torch.Tensor]] = [{}]
        used = 0
        for key, tensor in weights.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and used + nbytes > limit:
                shards.append({})
                used = 0
            shards[-1][key] = tensor
            used += nbytes
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        weight_map = {}
        for file, shard in zip(names, shards, strict=True):
            save_file(shard, out / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {
            "metadata": {"total_size": total, "total_parameters": sum(t.numel() for t in weights.values())},
            "weight_map": weight_map,
        }
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for file, data in self.files.items():
            (out / file).write_bytes(data)
        return names, sum((out / f).stat().st_size for f in names)


def _hf_config_dir(path: str, cache: Path) -> Path:
    """A local directory with the model's config files: its own (local, hub), or for an
    ``s3://`` model a fresh one with only those files downloaded (not its weights).
    """
    from trainer.models.hf import model_dir

    if not is_remote(path):
        return model_dir(path, cache)
    store = open_storage(path)
    try:
        keys = store.list()
        if CONFIG not in keys:
            raise ParameterError("model", f"hf:{path}: no {CONFIG} under that prefix")
        dest = Path(tempfile.mkdtemp(prefix="rfsdp-export-config."))
        for file in (CONFIG, GENERATION_CONFIG):
            if file in keys:
                store.download(file, dest / file)
    except StorageError as e:
        raise ParameterError("model", f"hf:{path}: {e}") from None
    return dest


def _config_dtype(config: dict) -> torch.dtype:
    """The dtype the config names (``dtype``, or ``torch_dtype`` before transformers 5), else float32."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name == "auto":
        return torch.float32
    if name not in _DTYPES:
        raise ParameterError(
            "model", f"its {CONFIG} names dtype {name!r}, which the export does not write ({', '.join(_DTYPES)})"
        )
    return _DTYPES[name]
