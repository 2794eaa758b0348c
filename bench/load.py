"""Loading a Hugging Face model's weights onto the ranks: the trainer's sharded read against
``from_pretrained`` on every rank. Each rank's peak anonymous memory (``RssAnon``, sampled every
5 ms: memory of its own, not the page cache's shared pages of the weight files) and its peak
resident memory (``ru_maxrss``, which counts the weight files' pages it touched too), and the
seconds until its FSDP model is ready, for a Llama-style model saved once with ``save_pretrained``:

- ``sharded``: the trainer's path (``build_fsdp_model``): parameters on the meta device, sharded,
  then each rank reads only its own rows from the safetensors files
- ``from_pretrained``: every rank loads the whole model with ``AutoModelForCausalLM.from_pretrained``,
  then shards it (FSDP2 frees the rows it does not keep)

A node's peak host memory is the sum of its ranks' anonymous memory plus one copy of the files
in the page cache (shared, and reclaimable); the full model's size in fp32 is shown beside it.
The methods run in interleaved repetitions on 2 CPU ranks under torchrun.
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path

from bench.common import fmt, fresh_dir, interleaved, median, print_table, print_targets, ratio, run_torchrun, target

METHODS = ("sharded", "from_pretrained")
FULL = {
    "shape": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    },
    "reps": 2,
}
"""About 350M parameters (1.4 GB in fp32): the issue's "about 300M"."""
QUICK = {
    "shape": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
    },
    "reps": 1,
}


def save_model(out: Path, shape: dict) -> int:
    """A Llama-style model with random weights, saved as Hugging Face saves it; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(max_position_embeddings=2048, **shape), dtype=torch.float32)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


class AnonPeak:
    """The highest ``RssAnon`` of this process from now until :meth:`stop`, sampled by a thread."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.before = self.peak = _anon_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            self.peak = max(self.peak, _anon_mib())

    def stop(self) -> tuple[float, float]:
        """(RssAnon when started, its peak since), MiB."""
        self._done.set()
        self._thread.join()
        return self.before, max(self.peak, _anon_mib())


def worker(args: argparse.Namespace) -> None:
    """One rank: build the sharded model one way, record peak RSS and seconds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM  # imported by both methods before the baseline: only the load counts

    from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group

    rt = detect_runtime()
    init_process_group(rt, None, timeout_s=900)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    anon = AnonPeak()
    t0 = time.perf_counter()
    if args.method == "sharded":
        model = build_fsdp_model(f"hf:{args.model}", rt, seed=0).module
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    dist.barrier()
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    anon_before, anon_peak = anon.stop()
    result = {
        "rank": rt.rank,
        "peak_rss_mib": peak / 1024,
        "rss_before_mib": before / 1024,
        "seconds": seconds,
        "local_params": local,
        "anon_before_mib": anon_before,
        "anon_peak_mib": anon_peak,
    }
    gathered = [None] * rt.world_size
    dist.all_gather_object(gathered, result)
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run(quick: bool, work: Path, data: Path) -> dict:
    """Save the model once, then load it both ways in interleaved repetitions."""
    params = QUICK if quick else FULL
    work = fresh_dir(work / "load")
    model_dir = work / "model"
    parameters = save_model(model_dir, params["shape"])
    samples: dict[str, list[list[dict]]] = {m: [] for m in METHODS}
    for rep, method in interleaved(METHODS, params["reps"]):
        out = work / f"{method}_{rep}.json"
        args = ["--method", method, "--model", str(model_dir), "--out", str(out)]
        code, _ = run_torchrun("bench.load", args, work / f"{method}_{rep}.log")
        if code:
            raise RuntimeError(f"load ({method}) failed with exit code {code}; log: {work / f'{method}_{rep}.log'}")
        samples[method].append(json.loads(out.read_text()))
    methods = {
        m: {
            "peak_rss_mib_per_rank": median([max(r["peak_rss_mib"] for r in ranks) for ranks in runs]),
            "load_rss_mib_per_rank": median(
                [max(r["peak_rss_mib"] - r["rss_before_mib"] for r in ranks) for ranks in runs]
            ),
            "load_anon_mib_per_rank": median(
                [max(r["anon_peak_mib"] - r["anon_before_mib"] for r in ranks) for ranks in runs]
            ),
            "peak_rss_mib_node": median([sum(r["peak_rss_mib"] for r in ranks) for ranks in runs]),
            "baseline_rss_mib": median([max(r["rss_before_mib"] for r in ranks) for ranks in runs]),
            "seconds": median([max(r["seconds"] for r in ranks) for ranks in runs]),
        }
        for m, runs in samples.items()
    }
    model_mib = parameters * 4 / 2**20
    for m in methods.values():
        m["anon_over_model"] = ratio(m["load_anon_mib_per_rank"] * 2, model_mib)  # the node's two ranks together
    methods["sharded"]["anon_ratio_vs_from_pretrained"] = ratio(
        methods["sharded"]["load_anon_mib_per_rank"], methods["from_pretrained"]["load_anon_mib_per_rank"]
    )
    p = {"parameters": parameters, "model_mib_fp32": model_mib, "ranks": 2, **params}
    sharded = methods["sharded"]
    targets = [
        target("sharded: a node's own memory for the load / the fp32 model <= 1.25", sharded["anon_over_model"], 1.25),
        target("sharded / from_pretrained own memory per rank <= 1.05", sharded["anon_ratio_vs_from_pretrained"], 1.05),
    ]
    return {"benchmark": "load", "params": p, "methods": methods, "targets": targets}


def show(result: dict) -> None:
    """Print the result as a table."""
    p = result["params"]
    rows = [
        [
            name,
            fmt(m["load_anon_mib_per_rank"], " MiB", 0),
            fmt(m["anon_over_model"], "x", 2),
            fmt(m["load_rss_mib_per_rank"], " MiB", 0),
            fmt(m["seconds"], " s", 1),
        ]
        for name, m in result["methods"].items()
    ]
    title = (
        f"loading a {p['parameters'] / 1e6:.0f}M-parameter Llama ({p['model_mib_fp32']:.0f} MiB fp32) "
        f"on {p['ranks']} ranks"
    )
    caption = (
        "own memory: a rank's peak RssAnon above its imports'; "
        "node / model: both ranks' own memory over the fp32 model; "
        "RSS: ru_maxrss above its imports' (with the weight files' shared pages)"
    )
    print_table(title, ["method", "own memory / rank", "node / model", "RSS / rank", "until sharded"], rows, caption)
    print_targets(result["targets"])


def main() -> None:
    """Entry point of one rank (under torchrun)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    worker(parser.parse_args())


if __name__ == "__main__":
    main()
