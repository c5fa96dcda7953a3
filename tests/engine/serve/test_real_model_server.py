"""The server with no --model serves the embedded Gemma 3 270M, and its greedy completion is right."""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engine.serve.harness import ServerProc, start_server

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[ServerProc]:
    # gemma_path assembles the default model first; the server then finds it without --model.
    srv = start_server(None, "--device", "cpu", "--max-context", "256", "--threads", "1")
    yield srv
    srv.stop()


def test_default_model_completion(gemma_server: ServerProc, gemma_path: Path) -> None:
    client = openai.OpenAI(
        base_url=gemma_server.url + "/v1", api_key=gemma_server.key, max_retries=0, timeout=120
    )
    models = client.models.list().data
    assert [m.id for m in models] == [gemma_path.name.removesuffix(".gguf")]
    r = client.completions.create(
        model=models[0].id, prompt="The capital of France is the city of", max_tokens=3, temperature=0
    )
    assert "Paris" in r.choices[0].text, r.choices[0].text
    chat = client.chat.completions.create(
        model=models[0].id, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
