"""A stream of chunks folded into one response: the non-streaming path and the CLI share it."""

from __future__ import annotations

from collections.abc import Iterable

from mlx_relay.protocol import relay_pb2 as pb


def aggregate(chunks: Iterable[pb.GenerateChunk]) -> pb.GenerateResponse:
    """The non-streaming answer is the stream, concatenated."""
    response = pb.GenerateResponse()
    text, reasoning = [], []
    for chunk in chunks:
        text.append(chunk.text)
        reasoning.append(chunk.reasoning)
        response.token_ids.extend(chunk.token_ids)
        response.tool_calls.extend(chunk.tool_calls)
        response.logprobs.extend(chunk.logprobs)
        response.request_id = chunk.request_id
        if chunk.finish_reason:
            response.finish_reason = chunk.finish_reason
            response.usage.CopyFrom(chunk.usage)
            response.timings.CopyFrom(chunk.timings)
            response.malformed_tool_call = chunk.malformed_tool_call
            response.unknown_tools.extend(chunk.unknown_tools)
            response.stop_sequence = chunk.stop_sequence
    response.text = "".join(text)
    response.reasoning = "".join(reasoning)
    return response
