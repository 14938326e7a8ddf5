"""``tandem`` is the front door: the public names import from it, lazily, so that the client
alone needs neither torch nor Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tandem

pytestmark = pytest.mark.unit


def test_the_public_names_are_the_classes_they_name():
    from cluster.engine.chat_template import ChatPrompt
    from cluster.engine.sampling_params import SamplingParams
    from cluster.offline.disaggregated import DisaggregatedLLM
    from cluster.offline.llm import LLM
    from tandem.client import TandemClient, TandemError

    assert (tandem.LLM, tandem.SamplingParams, tandem.ChatPrompt, tandem.DisaggregatedLLM, tandem.TandemClient,
            tandem.TandemError) == (LLM, SamplingParams, ChatPrompt, DisaggregatedLLM, TandemClient, TandemError)
    assert {"LLM", "SamplingParams", "DisaggregatedLLM", "TandemClient"} <= set(tandem.__all__) <= set(dir(tandem))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        tandem.Engine  # noqa: B018


def test_the_client_alone_imports_neither_torch_nor_ray():
    code = ("import sys; from tandem import TandemClient, TandemError; "
            "print(sorted(m for m in ('torch', 'ray', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
