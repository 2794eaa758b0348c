"""The NVRx and torch internals the async writer relies on (its queues start multiprocessing's
resource tracker, a process). The rest of the fast checks: tests/unit/test_units.py.
"""

from __future__ import annotations

import multiprocessing
import queue


def test_outside_internals_the_async_writer_relies_on() -> None:
    """Private NVRx 0.4.1 and torch 2.13 APIs used by ``trainer.rank.resilience.async_writer``
    (listed there): an upgrade that moves them fails here, not in a training run."""
    import importlib.metadata
    import inspect

    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller
    from torch.distributed import _state_dict_utils

    from trainer.rank.resilience import _ForkedCaller
    from trainer.rank.resilience.nvrx_version import NVRX_CHECKED

    assert importlib.metadata.version("nvidia-resiliency-ext") == NVRX_CHECKED == "0.4.1"
    caller = PersistentAsyncCaller()
    assert caller.process is None and hasattr(caller.queue, "put") and hasattr(caller.comp_q, "get_nowait")
    assert hasattr(caller.preload_q, "get")
    assert (
        vars(_ForkedCaller(multiprocessing.get_context("fork"))).keys() == vars(caller).keys()
    )  # its fields, our queues
    # The worker loop, started by the writer itself (NVRx always spawns it).
    assert list(inspect.signature(PersistentAsyncCaller.async_loop).parameters) == [
        "rank",
        "queue",
        "preload_q",
        "comp_q",
        "log_level",
    ]
    assert "if self.process is None:" in inspect.getsource(PersistentAsyncCaller.schedule_async_call)
    # The worker replaces the request's second argument with the preloaded buckets (CUDA).
    assert "async_fn_args[1] = item.preload_fn()" in inspect.getsource(PersistentAsyncCaller.async_loop)
    save_fn = filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc
    assert list(inspect.signature(save_fn).parameters) == [
        "transform_list",
        "use_msc",
        "rank",
        "write_buckets",
        "global_results_queue",
    ]
    # The results queue is this global, created on first use when it is None.
    assert filesystem_async._results_queue is None or isinstance(filesystem_async._results_queue, queue.SimpleQueue)
    assert "global _results_queue" in inspect.getsource(filesystem_async._get_write_results_queue)
    assert callable(_state_dict_utils._copy_state_dict) and callable(_state_dict_utils._create_cpu_state_dict)
