"""How the adapter ends a stream on Triton's vLLM interface (TritonGenerateBackend.stream), with a
stand-in for tritonclient's aio stream: a stream the backend answered in full is let end as Triton
ends it, never cancelled (cancelling it raced tritonserver's own completion: tritonserver died of
signal 11 in a fresh-clone e2e run); one left unanswered is cancelled, so the backend aborts it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
import pytest

from sluice_common.errors import Unavailable
from sluice_common.sampling import Sampling
from sluice_inference_adapter.triton_backend import TritonGenerateBackend


class VllmResult:
    """One response of the vLLM interface with its additional outputs."""

    def __init__(self, text: str, finish: str | None) -> None:
        self.columns: dict[str, np.ndarray] = {
            "text_output": np.array([text.encode()], dtype=np.object_),
            "num_input_tokens": np.array([5], dtype=np.uint32),
            "num_output_tokens": np.array([1], dtype=np.uint32),
        }
        if finish is not None:
            self.columns["finish_reason"] = np.array([finish.encode()], dtype=np.object_)

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.columns.get(name)

    def get_response(self) -> Any:
        class Response:
            parameters: dict[str, Any] = {}

        return Response()


class Failure:
    def message(self) -> str:
        return "the model's instance crashed"


class TritonStandIn:
    """Streams `responses` (a result, or an error), then ends the stream as Triton does once the
    last response is out and the client has sent its request."""

    def __init__(self, responses: list[VllmResult | Failure]) -> None:
        self.responses = responses
        self.cancelled = 0
        self.ended = 0
        self.requests: list[dict[str, Any]] = []

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]], stream_timeout: float | None = None) -> Any:
        stand_in = self

        class Responses:
            def __init__(self) -> None:
                self._iterator = self._responses()

            def __aiter__(self) -> AsyncIterator[tuple[Any, Any]]:
                return self._iterator

            async def _responses(self) -> AsyncIterator[tuple[Any, Any]]:
                async for request in requests:
                    stand_in.requests.append(request)
                for response in stand_in.responses:
                    yield (None, response) if isinstance(response, Failure) else (response, None)
                await asyncio.sleep(0)
                stand_in.ended += 1

            def cancel(self) -> None:
                stand_in.cancelled += 1

        return Responses()


def backend(stand_in: TritonStandIn) -> TritonGenerateBackend:
    generate = TritonGenerateBackend("127.0.0.1:1", "smollm2_generate")
    generate._client = stand_in  # type: ignore[assignment]
    return generate


async def read(stand_in: TritonStandIn) -> list[str]:
    async with aclosing(backend(stand_in).stream("hi", Sampling(max_tokens=2))) as chunks:
        return [chunk.text async for chunk in chunks]


async def test_an_answered_stream_ends_as_triton_ends_it_and_is_not_cancelled() -> None:
    stand_in = TritonStandIn([VllmResult("Hel", None), VllmResult("lo", "length")])
    assert await read(stand_in) == ["Hel", "lo"]
    assert (stand_in.ended, stand_in.cancelled) == (1, 0)


async def test_a_stream_is_sent_with_its_request_id_as_tritons_request_id() -> None:
    """tritonclient's stream_infer takes a request dict's `request_id` as the KServe request's id,
    which Triton names the request by in its own log and trace lines: the join to the adapter's."""
    stand_in = TritonStandIn([VllmResult("Hi", "length")])
    async with aclosing(backend(stand_in).stream("hi", Sampling(max_tokens=2), request_id="req-42")) as chunks:
        assert [chunk.text async for chunk in chunks] == ["Hi"]
    assert [request.get("request_id") for request in stand_in.requests] == ["req-42"]


async def test_a_stream_its_caller_leaves_before_the_last_response_is_cancelled() -> None:
    stand_in = TritonStandIn([VllmResult("Hel", None), VllmResult("lo", None), VllmResult("!", "length")])
    async with aclosing(backend(stand_in).stream("hi", Sampling(max_tokens=3))) as chunks:
        async for chunk in chunks:
            assert chunk.text == "Hel"
            break
    assert (stand_in.ended, stand_in.cancelled) == (0, 1)


async def test_an_error_response_is_the_last_and_ends_as_triton_ends_it() -> None:
    stand_in = TritonStandIn([VllmResult("Hel", None), Failure()])
    with pytest.raises(Unavailable, match="the model's instance crashed"):
        await read(stand_in)
    assert (stand_in.ended, stand_in.cancelled) == (1, 0)


class SilentTriton:
    """A Triton that answers its ready checks but never a stream (an engine wedged mid-forward)."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        return True

    async def is_model_ready(self, model: str, client_timeout: float | None = None) -> bool:
        return True

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]], stream_timeout: float | None = None) -> Any:
        stand_in = self

        class Responses:
            def __aiter__(self) -> Any:
                return self

            async def __anext__(self) -> tuple[Any, Any]:
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            def cancel(self) -> None:
                stand_in.cancelled += 1

        return Responses()


@pytest.mark.parametrize("bounded_by", ["step_timeouts", "fixed"])
async def test_a_probe_whose_token_never_comes_fails_within_its_timeout(bounded_by: str) -> None:
    """The probe's one-token stream had no time limit: a hung replica held its probe, and with it
    every replica's probe round (the pool awaited them together), for ever."""
    from sluice_common.adaptive_timeout import TimeoutPolicy
    from sluice_inference_adapter.step_timeout import StepTimeouts

    if bounded_by == "step_timeouts":  # as the adapter builds it: the pool's adaptive limit (cold: its ceiling)
        generate = TritonGenerateBackend("127.0.0.1:1", "m", timeouts=StepTimeouts(TimeoutPolicy(floor_s=0.05, ceiling_s=0.2)))
    else:
        generate = TritonGenerateBackend("127.0.0.1:1", "m", probe_timeout_s=0.2)
    silent = SilentTriton()
    generate._client = silent  # type: ignore[assignment]
    probe = asyncio.ensure_future(generate.probe())
    done, _ = await asyncio.wait({probe}, timeout=2.0)
    if not done:
        probe.cancel()
    assert done, "the probe never ended"
    with pytest.raises(TimeoutError, match="did not arrive within its timeout of 0.20s"):
        probe.result()
    assert silent.cancelled == 1  # the stream was cancelled: the engine aborts the request
