"""SamplingParams validation: every error is an InvalidRequestError naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.structured.spec import StructuredOutput

pytestmark = pytest.mark.unit

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", "16"),
    ("max_tokens", True),
    ("max_tokens", None),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", "1"),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", False),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", [0.1]),
    ("seed", -1),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    ("stop", ""),
    ("stop", [""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", {"a": 1}),
    ("stop", ["ok", None]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["3"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", "3"),
    ("stop_token_ids", 1.5),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", "1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", "x"),
    ("frequency_penalty", 3),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.5),
    ("logprobs", True),
]


def _id(case):
    field, value = case
    return f"{field}={value!r}"


@pytest.mark.parametrize("field,value", INVALID, ids=[_id(c) for c in INVALID])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)
    # The same through the flat mapping a JSON line becomes.
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_mapping({field: value})
    assert field in str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [
        pytest.param("temperature", math.nan, id="temperature=nan"),
        pytest.param("repetition_penalty", math.nan, id="repetition_penalty=nan"),
        pytest.param("temperature", math.inf, id="temperature=inf"),
        pytest.param("repetition_penalty", math.inf, id="repetition_penalty=inf"),
        # torch.Generator.manual_seed takes at most 64 bits; a larger seed crashes the engine later.
        pytest.param("seed", 2**64, id="seed=2**64"),
    ],
)
def test_non_finite_numbers_and_oversized_seed_are_rejected(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_invalid_request_error_is_a_value_error():
    assert issubclass(InvalidRequestError, ValueError)


def test_from_mapping_rejects_unknown_keys_naming_them():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_mapping({"temprature": 0.5, "max_tokens": 4, "top_n": 3})
    message = str(info.value)
    assert "temprature" in message and "top_n" in message
    assert "max_tokens" not in message
    # Request-level keys of an input line are not sampling fields either.
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams.from_mapping({"priority": 1})


def test_defaults_are_valid():
    params = SamplingParams()
    assert params == SamplingParams.from_mapping({})
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop == ()
    assert params.stop_token_ids == ()
    assert params.ignore_eos is False
    assert params.repetition_penalty == 1.0
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.logprobs is None
    assert not params.greedy
    assert not params.has_penalties


def test_field_names():
    assert SamplingParams.field_names() == {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "speculative",
        "structured",
    }


def test_boundary_values_are_valid():
    params = SamplingParams(
        max_tokens=1, temperature=0, top_p=1.0, top_k=0, min_p=1.0, seed=0, repetition_penalty=0.01,
        presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20, stop_token_ids=[0],
    )
    assert params.greedy
    assert params.has_penalties
    SamplingParams(min_p=0.0, logprobs=0, presence_penalty=2, frequency_penalty=-2, top_p=1e-6, seed=2**63 - 1)


def test_stop_fields_become_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    assert SamplingParams.from_mapping({"stop_token_ids": [3, 4]}).stop_token_ids == (3, 4)
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))  # hashable, since lists became tuples


def test_from_mapping_builds_every_field():
    values = {
        "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11,
        "stop": ["\n\n"], "stop_token_ids": [2], "ignore_eos": True, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3, "speculative": False,
        "structured": StructuredOutput("regex", "[0-9]+", source="regex"),
    }
    params = SamplingParams.from_mapping(values)
    assert params.structured is values["structured"]
    as_dict = dataclasses.asdict(params)
    assert as_dict == {**values, "stop": ("\n\n",), "stop_token_ids": (2,),
                       "structured": {"kind": "regex", "value": "[0-9]+", "syntax": "", "source": "regex"}}


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().max_tokens = 3  # type: ignore[misc]
