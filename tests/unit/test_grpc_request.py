"""A ``GenerateRequest`` as the request path takes it: the sampling fields the client sets reach
``SamplingParams`` (``speculative`` among them), and those it leaves unset take the server's
defaults."""

from __future__ import annotations

import pytest

from cluster.engine.sampling_params import SamplingParams
from cluster.ingress.grpc_server import request_payload
from tandem.client import build_generate_request

pytestmark = pytest.mark.unit


def test_a_request_may_opt_out_of_speculative_decoding():
    request, _ = request_payload(build_generate_request("hi", max_tokens=5, speculative=False))
    assert request.sampling == {"max_tokens": 5, "speculative": False}
    assert SamplingParams.from_mapping(request.sampling).speculative is False
    assert request_payload(build_generate_request("hi", speculative=True))[0].sampling == {"speculative": True}


def test_unset_sampling_fields_take_the_servers_defaults():
    request, tool_format = request_payload(build_generate_request([1, 2, 3]))
    assert tool_format is None and request.sampling == {} and request.prompt == [1, 2, 3]
    assert SamplingParams.from_mapping(request.sampling).speculative is True
