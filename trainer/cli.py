"""``rfsdp``: the command line of resilient-fsdp (see ``rfsdp --help``)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from trainer.app_commands import add_app_commands
from trainer.data import BUILTIN_CORPUS
from trainer.data.prepare import DEFAULT_SHARD_TOKENS
from trainer.errors import FATAL_EXIT_CODE
from trainer.events import EVENTS_FILE, Fatal, RunEnd, RunStart, fatal_error, latest_end, read_events
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig, add_train_arguments
from trainer.results.tracking import DEFAULT_EXPERIMENT


def _prepare_data(args: argparse.Namespace) -> int:
    from trainer.data.prepare import prepare_dataset

    manifest = prepare_dataset(
        args.source,
        args.out,
        shard_tokens=args.shard_tokens,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        train_tokenizer=args.train_tokenizer,
    )
    splits = ", ".join(
        f"{k}: {v['tokens']:,} tokens in {len(v['shards'])} shard(s)" for k, v in manifest["splits"].items()
    )
    print(
        f"prepared {args.out} ({splits}; tokenizer {manifest['tokenizer']}, vocab {manifest['vocab_size']:,}, "
        f"{manifest['dtype']}; {manifest['skipped_records']:,} record(s) without {manifest['text_field']!r} skipped)"
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from trainer.launch.local import launch_local

    spec = LaunchSpec(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts)
    args.world_size = spec.world_size
    cfg = TrainConfig.from_mapping(vars(args))
    with _tracking(args, Path(cfg.run_dir)):
        try:
            if args.netns:  # each replica on its own network-namespace host, torn down afterwards
                from trainer.emulation.netns import LocalCluster

                with LocalCluster(spec.nnodes) as cluster:
                    code = launch_local(cfg, spec, progress=not args.quiet, placement=cluster)
            else:
                code = launch_local(cfg, spec, progress=not args.quiet)
        except Terminated:  # preempted: a clean end if every rank checkpointed the step it reached
            end = latest_end(read_events(Path(cfg.run_dir), [RunStart, RunEnd]))
            if end is None or end.status != "preempted":
                raise
            print(
                f"rfsdp train: preempted at step {end.step}, checkpointed: the same command resumes it", file=sys.stderr
            )
            code = 0
    if code:
        logs = Path(cfg.run_dir) / "logs"
        if code == FATAL_EXIT_CODE and (fatal := fatal_error(read_events(Path(cfg.run_dir), [Fatal]))):
            print(
                f"rfsdp train: stopped for good on rank {fatal.rank}, no restart can fix: "
                f"{fatal.error}; logs in {logs}",
                file=sys.stderr,
            )
            return FATAL_EXIT_CODE
        print(f"rfsdp train: the job failed (exit code {code}); logs in {logs}", file=sys.stderr)
        return 1
    from trainer.results.summary import print_run_summary

    print_run_summary(Path(cfg.run_dir))
    return 0


@contextlib.contextmanager
def _tracking(args: argparse.Namespace, run_dir: Path) -> Iterator[None]:
    """With ``--tracking-uri``: MLflow follows the run while it trains, and gets all of it at the
    end (a tracking server that is down costs nothing but a line: ``rfsdp log-mlflow`` later).
    """
    if not args.tracking_uri:
        yield
        return
    from trainer.results.tracking import LiveLogger, TrackingError, check_tracking_uri, log_run, redact_uri

    check_tracking_uri(args.tracking_uri)
    try:
        with LiveLogger(run_dir, tracking_uri=args.tracking_uri, experiment=args.experiment):
            yield
    finally:
        if (run_dir / EVENTS_FILE).is_file():
            try:
                run_id = log_run(run_dir, tracking_uri=args.tracking_uri, experiment=args.experiment, retries=2)
                print(
                    f"rfsdp train: MLflow run {run_id} in {args.experiment!r} at {redact_uri(args.tracking_uri)}",
                    file=sys.stderr,
                )
            except (TrackingError, ValueError) as e:
                print(f"rfsdp train: not logged to MLflow: {e}", file=sys.stderr)


def _local_run_dir(uri: str) -> Path:
    """``--run-dir`` as a local directory: an ``s3://`` run dir (a ``--checkpoint-uri``) is fetched,
    checksums verified, into a temporary directory removed when the command exits.
    """
    from trainer.storage.store import fetch_run_dir, is_remote

    if not is_remote(uri):
        return Path(uri)
    tmp = tempfile.mkdtemp(prefix="rfsdp-run-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return fetch_run_dir(uri, Path(tmp) / "run")


def _validate(args: argparse.Namespace) -> int:
    import json

    from trainer.fsutil import atomic_write_text
    from trainer.results.validate import validate_run

    if args.markdown and not Path(args.markdown).parent.is_dir():
        raise ValueError(f"--markdown: directory {Path(args.markdown).parent} does not exist")
    report = validate_run(
        _local_run_dir(args.run_dir),
        step=args.step,
        data=Path(args.data) if args.data else None,
        fallback=args.fallback,
        quality_margin=args.quality_margin,
        replay_steps=args.replay_steps,
    )
    print(json.dumps(report.to_dict(), indent=2))
    if args.markdown:
        atomic_write_text(Path(args.markdown), report.to_markdown())
    print(f"rfsdp validate: {report.summary()}", file=sys.stderr)
    return 0 if report.valid else 1


def _export(args: argparse.Namespace) -> int:
    from trainer.results.export import export_run

    result = export_run(
        _local_run_dir(args.run_dir),
        args.out,
        step=args.step,
        data=Path(args.data) if args.data else None,
        max_shard_size=args.max_shard_size,
    )
    tokenizer = ", with the data set's tokenizer" if result.tokenizer else ""
    print(
        f"exported step {result.step} of {args.run_dir} to {result.out}: "
        f"{result.kind} model, {result.tensors} tensors, {result.bytes:,} bytes of {result.dtype} weights; "
        f"{len(result.files)} files{tokenizer}"
    )
    return 0


def _log_mlflow(args: argparse.Namespace) -> int:
    import json

    from trainer.results.tracking import TrackingError, log_run

    tags = {}
    for item in args.tag:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--tag: expected KEY=VALUE, got {item!r}")
        tags[name] = value
    validation = None
    if args.validation:
        try:
            validation = json.loads(Path(args.validation).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--validation: cannot read a JSON report from {args.validation} ({e})") from e
    try:
        run_id = log_run(
            _local_run_dir(args.run_dir),
            tracking_uri=args.tracking_uri,
            experiment=args.experiment,
            tags=tags,
            validation=validation,
            retries=args.retries,
        )
    except TrackingError as e:
        print(f"rfsdp log-mlflow: error: {e}", file=sys.stderr)
        return 1
    print(run_id)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``rfsdp`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="rfsdp", description="Resilient FSDP training as a Kubeflow pipeline.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('resilient-fsdp')}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-data", help="tokenize a corpus into checksummed shards")
    p.add_argument(
        "--source",
        default=BUILTIN_CORPUS,
        help="corpus: text, .jsonl or .parquet file, dir or s3:// prefix "
        "(default: the Python docs that ship with Python)",
    )
    p.add_argument("--out", required=True, help="output directory or s3://bucket/prefix for shards + manifest.json")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    p.add_argument(
        "--tokenizer",
        help="Hugging Face tokenizer directory or tokenizer.json, local or s3:// (default: byte-level UTF-8)",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON lines field / Parquet column holding a record's text (default: text)"
    )
    p.add_argument(
        "--train-tokenizer",
        type=int,
        default=0,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE of this vocabulary size on the corpus",
    )
    p.set_defaults(func=_prepare_data)

    p = sub.add_parser(
        "train",
        help="run resilient FSDP training locally (ft_launcher per replica)",
        epilog="example: rfsdp train --data work/data --run-dir work/run --steps 60 "
        "--fault exception@15:1,sigkill@30:0",
    )
    add_train_arguments(p, include_world=False)
    launch = LaunchSpec()
    p.add_argument("--nnodes", type=int, default=launch.nnodes, help="replicas (nodes)")
    p.add_argument("--nproc-per-node", type=int, default=launch.nproc_per_node, help="worker processes per replica")
    p.add_argument("--max-restarts", type=int, default=launch.max_restarts, help="in-job restarts ft_launcher may do")
    p.add_argument(
        "--netns",
        action="store_true",
        help="each replica on its own network-namespace host (root; replicas restart like pods)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--config",
        help="TOML (or .yaml) file of these options, keys in snake_case (steps = 60); options given here override it",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI: the run is logged while it trains and when it ends (default: not logged)",
    )
    p.add_argument(
        "--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment, with --tracking-uri (default: %(default)s)"
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "validate", help="prove a run's checkpoint is usable: JSON verdict; exit 0 valid, 1 invalid, 2 could not run"
    )
    p.add_argument(
        "--run-dir",
        required=True,
        help="run directory with checkpoints/ and events.jsonl (or an s3:// --checkpoint-uri)",
    )
    p.add_argument("--step", type=int, help="validate this published checkpoint (default: the latest)")
    p.add_argument("--data", help="prepared data directory (default: the one the run recorded)")
    p.add_argument(
        "--fallback", action="store_true", help="when it is invalid, report the newest older checkpoint that is valid"
    )
    p.add_argument(
        "--quality-margin", type=float, default=0.5, help="eval loss must be this much below the loss at initialization"
    )
    p.add_argument(
        "--replay-steps",
        type=int,
        default=3,
        help="steps to resume from the checkpoint and compare with the run's losses",
    )
    p.add_argument("--markdown", help="also write the table of checks as Markdown to this file")
    p.set_defaults(func=_validate)

    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a model directory (Hugging Face for hf: models; docs/models.md)",
        epilog="example: rfsdp export --run-dir work/run --out work/model  "
        "(then AutoModelForCausalLM.from_pretrained('work/model'))",
    )
    p.add_argument("--run-dir", required=True, help="run directory with checkpoints/ (or an s3:// --checkpoint-uri)")
    p.add_argument("--step", type=int, help="export this published checkpoint (default: the latest)")
    p.add_argument("--out", required=True, help="a new or empty directory, or an empty s3://bucket/prefix")
    p.add_argument(
        "--data", help="prepared data directory whose tokenizer goes with the model (default: the one the run recorded)"
    )
    p.add_argument(
        "--max-shard-size",
        default="2GB",
        metavar="SIZE",
        help="most bytes per safetensors file of an hf: model (default: %(default)s)",
    )
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "log-mlflow", help="log a run dir to MLflow (one run per run dir, idempotent); prints the run id"
    )
    p.add_argument("--run-dir", required=True, help="run directory with events.jsonl (or an s3:// --checkpoint-uri)")
    p.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite in work/mlflow/)"
    )
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    p.add_argument("--validation", help="JSON file with the `rfsdp validate` verdict, logged as an artifact")
    p.add_argument("--tag", action="append", default=[], help="extra run tag KEY=VALUE (repeatable)")
    p.add_argument(
        "--retries", type=int, default=5, help="attempts to reach a tracking server (exponential backoff from 1 s)"
    )
    p.set_defaults(func=_log_mlflow)

    add_app_commands(sub)  # pipeline, cluster, bench
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM: a scheduler's stop (eviction, preemption)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(f"signal {signum}")


def _config_defaults(parser: argparse.ArgumentParser, command: str, path: Path) -> None:
    """Make the options in ``path`` (TOML, or YAML for .yaml/.yml; keys are the options' names in
    snake_case, as the pipeline's parameters) the defaults of ``command``.

    Raises:
        ValueError: an unreadable file or an unknown key, naming it.
    """
    import tomllib

    import yaml

    try:
        text = path.read_text()
        values = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else tomllib.loads(text)
    except (OSError, yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config: cannot read {path} ({e})") from None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}
    if not isinstance(values, dict):
        raise ValueError(f"--config: {path} is not a table of options")
    for key, value in values.items():
        if key not in options:
            raise ValueError(f"--config: unknown key {key!r} in {path} (known: {', '.join(sorted(options))})")
        if options[key].type is None and not isinstance(value, bool | str | None):
            raise ValueError(f"--config: {key} in {path} must be true or false, got {value!r}")
    # Strings, so that argparse converts and checks them like the flag's own value.
    sub.set_defaults(**{k: v if isinstance(v, bool | None) else str(v) for k, v in values.items()})


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rfsdp`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):  # the file's values become defaults: flags given override them
        try:
            _config_defaults(parser, args.command, Path(args.config))
        except ValueError as e:
            print(f"rfsdp {args.command}: error: {e}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # A scheduler stops us with SIGTERM: unwind like Ctrl-C, so that what we started (replica
        # launchers run in their own sessions) is stopped, gracefully, instead of orphaned.
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"rfsdp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rfsdp {args.command}: stopped; the processes it started are stopped too", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
