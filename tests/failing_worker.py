"""A weight-sync worker whose Nth weight load fails after loading half its tensors, as a real load
may (a CUDA error, a model family loaded wrongly), which cannot be produced at will here. A server
started with ASYNC_GRPO_WORKER=tests.failing_worker.FailingLoadWorker and ASYNC_GRPO_FAIL_LOAD=N
runs it in its vLLM workers (tests/test_weight_sync.py)."""

import os

from engine import WeightSyncWorker


class FailingLoadWorker(WeightSyncWorker):
    # loads since the worker started
    loads = 0

    def load(self, received):
        self.loads += 1
        if self.loads == int(os.environ["ASYNC_GRPO_FAIL_LOAD"]):
            super().load(received[: len(received) // 2])
            raise RuntimeError("ASYNC_GRPO_FAIL_LOAD: failed after half the tensors")
        return super().load(received)
