"""The documented limits of one request, and error messages that quote at most about 100
characters of what the user sent, wherever a request comes in (sampling fields, request ids,
SLO classes, ``tandem run`` lines)."""

from __future__ import annotations

import json

import pytest

from cluster.offline.run_file import _parse, _result
from cluster.engine.request_limits import (
    MAX_ECHO_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_SLO_CLASS_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_UINT32,
    MAX_USER_CHARS,
    InvalidRequestError,
    check_priority,
    check_request_id,
    check_slo_class,
    check_stop_token_ids,
    check_user,
    clip,
    quote,
)
from cluster.engine.sampling_params import SamplingParams
from router.config import RouterConfig, RouterConfigError

pytestmark = pytest.mark.unit

HUGE = "x" * 10_000
SHORT_MESSAGE = MAX_ECHO_CHARS + 150  # the longest any of these messages may be


def refused(**fields) -> str:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    return str(info.value)


def test_quote_clips_long_values_and_says_how_much_is_left_out():
    assert quote("gold") == "'gold'"
    assert quote(12) == "12"
    clipped = quote(HUGE)
    assert clipped == "'" + "x" * (MAX_ECHO_CHARS - 1) + "... (9902 more characters)"
    assert clip("abc", 2) == "ab... (1 more characters)"
    assert quote(10**5000) == "an integer of more than 4300 digits"


@pytest.mark.parametrize("fields, words", [
    (dict(temperature=HUGE), "temperature must be a finite number, got 'xxx"),
    (dict(temperature=10**400), "temperature must be a finite number, got 1000"),
    (dict(top_p=10**300), "top_p must be in (0, 1], got 1000"),
    (dict(max_tokens=HUGE), "max_tokens must be an integer, got 'xxx"),
    (dict(seed=10**4000), "seed must be <= 18446744073709551615, got 1000"),
    (dict(stop=[1, HUGE]), "stop must be a list of str, got item 1"),
    (dict(stop_token_ids=[HUGE]), "stop_token_ids must be a list of int, got item 'xxx"),
    (dict(ignore_eos=HUGE), "ignore_eos must be true or false, got 'xxx"),
])
def test_sampling_errors_quote_at_most_about_100_characters(fields, words):
    message = refused(**fields)
    assert message.startswith(words)
    assert len(message) < SHORT_MESSAGE


def test_unknown_sampling_fields_are_clipped():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_mapping({HUGE: 1})
    assert str(info.value).startswith("unknown sampling field(s): xxx") and len(str(info.value)) < SHORT_MESSAGE


def test_stop_strings_and_stop_ids_have_limits():
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS])
    assert refused(stop=["s"] * (MAX_STOP_STRINGS + 1)) == "stop: 17 stop strings; at most 16 are allowed"
    assert refused(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))) == (
        "stop_token_ids: 65 ids; at most 64 are allowed")
    message = refused(stop=["ok", HUGE])
    assert message.startswith("a stop string is 10000 characters long; at most 256 are allowed: 'xxx")
    assert len(message) < SHORT_MESSAGE


def test_request_id_and_slo_class_lengths():
    check_request_id("r" * MAX_REQUEST_ID_CHARS)
    check_slo_class("c" * MAX_SLO_CLASS_CHARS)
    check_slo_class(None)
    with pytest.raises(InvalidRequestError, match=r"^request_id is 257 characters long; at most 256 are allowed"):
        check_request_id("r" * (MAX_REQUEST_ID_CHARS + 1))
    with pytest.raises(InvalidRequestError) as info:
        check_slo_class(HUGE)
    assert str(info.value).startswith("slo_class is 10000 characters long; at most 64 are allowed: 'xxx")
    assert len(str(info.value)) < SHORT_MESSAGE


def test_user_priority_max_tokens_and_top_k_have_the_grpc_apis_ranges():
    check_user("u" * MAX_USER_CHARS)
    with pytest.raises(InvalidRequestError) as info:
        check_user(HUGE)
    assert str(info.value).startswith("user is 10000 characters long; at most 256 are allowed: 'xxx")
    assert len(str(info.value)) < SHORT_MESSAGE
    check_priority(2**31 - 1)
    check_priority(-(2**31))
    for priority in (2**31, -(2**31) - 1, 10**400):
        with pytest.raises(InvalidRequestError, match=r"^priority must be in \[-2147483648, 2147483647\], got "):
            check_priority(priority)
    SamplingParams(max_tokens=MAX_UINT32, top_k=MAX_UINT32)
    assert refused(max_tokens=MAX_UINT32 + 1) == "max_tokens must be <= 4294967295, got 4294967296"
    assert refused(top_k=10**30) == "top_k must be <= 4294967295, got 1000000000000000000000000000000"


def test_stop_token_ids_must_be_in_the_vocabulary():
    check_stop_token_ids([0, 511], 512)
    with pytest.raises(InvalidRequestError, match=r"^stop_token_ids must be in \[0, 512\); got \[512, 100000\]$"):
        check_stop_token_ids([3, 512, 100000], 512)


def test_unknown_slo_class_is_clipped_and_class_names_have_the_request_limit():
    with pytest.raises(RouterConfigError) as info:
        RouterConfig().slo_class(HUGE)
    assert str(info.value).startswith("unknown slo_class 'xxx") and len(str(info.value)) < SHORT_MESSAGE
    assert str(info.value).endswith("; known: interactive, standard, batch")
    RouterConfig.from_mapping({"slo_classes": {"c" * MAX_SLO_CLASS_CHARS: {}}, "default_class": "c" * 64})
    with pytest.raises(RouterConfigError, match="a class name may have at most 64 characters"):
        RouterConfig.from_mapping({"slo_classes": {"c" * 65: {}}, "default_class": "c" * 65})


# -- tandem run lines -------------------------------------------------------------------------

@pytest.mark.parametrize("given", [17, "17", "a b"])
def test_a_line_id_comes_back_with_its_json_type(given):
    entry, item = _parse(1, json.dumps({"id": given, "prompt": "hi"}))
    assert entry.error is None and entry.request_id == str(given) and entry.given_id == given
    row = _result(entry, None)
    assert row["id"] == given and type(json.loads(json.dumps(row))["id"]) is type(given)


def test_a_line_id_longer_than_the_limit_is_refused():
    entry, item = _parse(4, json.dumps({"id": "i" * (MAX_REQUEST_ID_CHARS + 1), "prompt": "hi"}))
    assert item is None and entry.error == "line 4: 'id' is 257 characters long; at most 256 are allowed"


def test_a_number_too_long_to_read_is_malformed_json():
    entry, item = _parse(2, '{"id": 1, "max_tokens": ' + "9" * 5000 + "}")
    assert item is None and entry.error == "line 2: malformed JSON: a number too long to read"
