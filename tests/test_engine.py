"""The engine in this process (engine.Engine, no HTTP): what only its own state shows.

Run: .venv/bin/python -m pytest tests/test_engine.py
"""

import asyncio

from vllm import SamplingParams
from vllm.engine.protocol import EngineClient
from vllm.v1.engine.async_llm import AsyncLLM

from engine import Engine, engine_args


def test_vllm_0_26_version_marks_of_a_cancelled_request_are_dropped(model_path, monkeypatch):
    """vLLM 0.26 (the GPU build) labels no tokens itself: at an in-flight update the engine reads
    how many tokens each paused request has (VersionLabels.label, once the output handler processed
    every output sent before the pause) and marks where the new version begins. That path runs
    here, on vLLM 0.32, with 0.32's own labelling hidden: a paused request gets a mark inside it,
    and a request cancelled afterwards leaves none behind in Engine.labels."""
    monkeypatch.delattr(AsyncLLM, "update_weight_version")
    monkeypatch.delattr(EngineClient, "update_weight_version")

    async def scenario():
        # forked, as server.py's (this process runs at one PyTorch thread: conftest)
        engine = Engine(engine_args(model_path), fork=True)
        try:
            params = SamplingParams(max_tokens=1500, ignore_eos=True)
            request = asyncio.ensure_future(engine.generate(["x"], params))
            await asyncio.sleep(1.0)
            async with engine.gate_closed("in-flight", 30, 30):
                await engine.bump(engine.version + 1, True, 30)
            marked = {k: v for k, v in engine.labels.marks.items()}
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            return marked, dict(engine.labels.marks)
        finally:
            engine.llm.shutdown()

    marked, after = asyncio.run(scenario())
    [[[version, tokens]]] = [spans for request in marked.values() for spans in request.values()]
    assert version == 1 and 0 < tokens < 1500
    assert after == {}
