"""examples/op_api.py (the op API without transformers) runs and its numbers make sense."""

import importlib.util
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import op_api  # noqa: E402

import kivi_cache  # noqa: E402


def _example(name: str):
    """examples/<name>.py as a fresh module, by path (benchmarks/ has a generate.py too: a plain import could find
    either, depending on which tests ran first)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bits,bound", [(8, 0.02), (4, 0.2)])
def test_op_api_example(bits, bound, capsys):
    errs = op_api.main(["--bits", str(bits), "--device", "cpu", "--lengths", "40,200"])
    assert len(errs) == 2 and max(errs) < bound
    out = capsys.readouterr().out
    assert "x less" in out and "same output as the op: True" in out


def test_generate_example_static_cache_gives_int4_tokens(capsys, monkeypatch, request):
    """examples/generate.py --static on SmolLM2 (CPU): the static int4 cache runs in generate and gives exactly the
    tokens of Int4PagedCache (fails if the static path stores or attends differently)."""
    pytest.importorskip("gguf")
    import torch
    from models import unbind_static

    # the model the tests share (conftest.py) instead of a second load: the example calls load_smollm2(torch.float32)
    # of examples/smollm2.py, which is what the fixture returns (load_smollm2 itself runs there)
    model, tok = request.getfixturevalue("smollm2")
    generate = _example("generate")

    def shared(dtype=torch.float32):
        assert dtype == torch.float32, dtype
        return model, tok

    monkeypatch.setattr(generate, "load_smollm2", shared)
    try:
        results = generate.main(["--bits", "4", "--static", "--max-new-tokens", "8", "--context-tokens", "200"])
    finally:
        unbind_static(model)  # the static cache bound itself to the shared model's attention modules
    tokens = {run["label"]: run["tokens"] for run in results}
    assert len(tokens) == 3 and all(len(t) == 8 for t in tokens.values())
    assert tokens["int4"] == tokens["int4 static"]
    assert "same tokens as Int4PagedCache: True" in capsys.readouterr().out


@pytest.mark.skipif(kivi_cache.cb.unsupported_reason() is not None, reason=str(kivi_cache.cb.unsupported_reason()))
def test_serve_example_streams_requests_through_both_caches(capsys, monkeypatch, request):
    """examples/serve.py on SmolLM2 (CPU): a stream of requests served by the engine's cache and by int8 pages;
    int8 gives the full-precision engine's tokens (near-lossless), and the pages hold more tokens in the same
    bytes."""
    pytest.importorskip("gguf")
    import torch

    model, tok = request.getfixturevalue("smollm2")
    serve = _example("serve")

    def shared(dtype=torch.float32):
        assert dtype == torch.float32, dtype
        return model, tok

    monkeypatch.setattr(serve, "load_smollm2", shared)
    monkeypatch.setattr(serve, "austen_chapters", lambda: [])  # the sample text, as on a machine without the data
    res = serve.main(["--preset", "int8", "--requests", "4", "--new-tokens", "8", "--arrival", "0.05",
                      "--max-prompt", "200"])
    assert res["requests"] == 4 and res["equal"] >= 3 and res["capacity_ratio"] > 3
    assert "int8 outputs equal to full precision's" in capsys.readouterr().out
