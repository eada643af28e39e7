"""Schema fuzzing: schemathesis generates requests from the live server's `/openapi.json` (tiny model,
real engine) — valid and invalid bodies, parameters and headers. No request may get a 5xx, and every
response must match the schema the server publishes for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.async_engine import AsyncEngine

KEY = "sk-schema"
MAX_EXAMPLES = 8  # per operation: the whole file stays well under a minute


@pytest.fixture(scope="module")
def live(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    # A short context: a generated request without max_tokens generates at most ~200 tokens.
    args = EngineArgs(str(tiny_model_dir("qwen2_vl")), max_num_batched_tokens=256, max_model_len=256,
                      num_kv_blocks=128)  # fmt: skip
    engine = AsyncEngine(args, media_limits=MediaLimits(max_items_per_prompt=2, decode_timeout_s=5.0))
    settings = ServerSettings(
        api_key=KEY, data_dir=tmp_path_factory.mktemp("schema-data"), served_model_name="tiny"
    )
    server = ServerThread(lambda: create_app(engine, settings))
    yield server
    server.stop()
    asyncio.run(engine.shutdown(1.0))


def test_no_server_errors_and_responses_match_the_schema(live: ServerThread) -> None:
    """Each operation of the published schema in turn, each with its own bounded hypothesis run; every
    operation is exercised even when an earlier one fails, and all failures are reported together.
    (schemathesis' pytest plugin, `from_fixture`, does not run under this pytest; the strategies do.)"""
    api = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    failures: dict[str, str] = {}
    labels = []
    for result in api.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in GenerationMode:  # valid requests, then ones that break the schema on purpose

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,  # the same requests every run
                database=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: report the first failing case
            )
            def run(case: schemathesis.Case) -> None:
                case.call_and_validate(
                    base_url=live.url,
                    headers={"Authorization": f"Bearer {KEY}"},
                    checks=[not_a_server_error, response_schema_conformance],
                    timeout=30,
                )

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, (
                    operation.label
                )  # no input of its can break the schema
            except Exception as exc:
                failures[f"{operation.label} ({mode.value})"] = str(exc)[:2000]
    assert "POST /v1/chat/completions" in labels and "POST /v1/files" in labels, labels
    assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())
