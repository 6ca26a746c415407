"""lm-eval end to end, offline, with the ``kivi`` model type on a tiny random Llama.

Both local task kinds of eval/tasks run: rolling perplexity (``austen_ppl``) and generation
(``austen_needle``). Their yaml files are copied with data_files pointing at small files
made here, so nothing depends on the working directory or the shared data.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13)")

from models import tiny_llama  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "eval" / "tasks"
SMALL = "group_size=16,residual_length=16,page_size=32"


def _words():
    from kivi_cache.models import sample_text

    return sample_text().split()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama and a word-level tokenizer over the sample's words, saved to a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials)}
    for w in _words():
        if w not in vocab and len(vocab) < 128:
            vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>")
    model = tiny_llama(layers=2)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 2, 3, 1
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 2, 3
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The committed task yamls, data_files redirected to small local files."""
    root = tmp_path_factory.mktemp("tasks")
    words = _words()
    with open(root / "ppl.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"book": "pp", "chapter": str(i), "text": " ".join(words[i * 40:i * 40 + 70])}) + "\n")
    with open(root / "needle.jsonl", "w") as f:
        for i, code in enumerate(["HERON-3", "PUFFIN-5"]):
            ctx = " ".join(words[:30]) + f" The secret code word is {code}. " + " ".join(words[30 + i:50])
            f.write(json.dumps({"context": ctx, "question": "What is the code?", "answer": code}) + "\n")
    for name, data in (("austen_ppl", "ppl.jsonl"), ("austen_needle", "needle.jsonl")):
        text = (TASKS / f"{name}.yaml").read_text()
        path = str(root / data)
        text = re.sub(r"(\n    test: ).*", lambda m, path=path: m.group(1) + path, text)
        (root / f"{name}.yaml").write_text(text)
    return root


def _evaluate(tiny_dir, task_dir, tasks, model_args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kivi_cache.lm_eval  # noqa: F401  registers "kivi"

    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model="kivi", model_args=f"pretrained={tiny_dir},{model_args}",
                                   tasks=tasks, task_manager=tm, device="cpu", batch_size=2,
                                   log_samples=True)


def test_registered():
    from lm_eval.api.registry import get_model

    from kivi_cache.lm_eval import KiviLM

    assert get_model("kivi") is KiviLM


def test_rolling_perplexity_and_generation(tiny_dir, task_dir, monkeypatch):
    """Both task kinds run through fresh quantized caches that really hold quantized tokens;
    int8 through the streaming scheme matches the full-precision reference."""
    from kivi_cache import QuantizedPagedCache
    from kivi_cache.lm_eval import KiviLM

    made = []
    new_cache = KiviLM.new_cache
    monkeypatch.setattr(KiviLM, "new_cache", lambda self: made.append(new_cache(self)) or made[-1])
    args = f"max_length=48,prefill_tokens=8,dtype=float32,{SMALL}"
    res8 = _evaluate(tiny_dir, task_dir, ["austen_ppl", "austen_needle"], f"key_bits=8,value_bits=8,{args}")
    assert len(made) >= 1 + 2 + 2  # the check at start, >= 2 rolling windows, 2 generations
    assert all(isinstance(c, QuantizedPagedCache) and c.quant_config.key_bits == 8 for c in made)
    used = [c.memory_report().quantized_tokens for c in made[1:]]
    assert all(n > 0 for n in used), used  # every request read quantized pages
    monkeypatch.undo()
    ref = _evaluate(tiny_dir, task_dir, ["austen_ppl"], "preset=fp,max_length=48,prefill_tokens=8,dtype=float32")
    ppl8 = res8["results"]["austen_ppl"]["word_perplexity,none"]
    ppl_ref = ref["results"]["austen_ppl"]["word_perplexity,none"]
    assert math.isfinite(ppl8) and ppl8 > 1
    assert abs(ppl8 / ppl_ref - 1) < 1e-2  # 8 bits: nearly lossless
    needle = res8["results"]["austen_needle"]
    assert "exact_match,code_word" in needle
    samples = res8["samples"]["austen_needle"]
    assert len(samples) == 2 and all(isinstance(s["resps"][0][0], str) for s in samples)


def test_two_bits_changes_scores(tiny_dir, task_dir):
    """The quantized cache is really read: 2-bit scores differ from the reference."""
    from lm_eval.api.registry import get_model

    import kivi_cache.lm_eval  # noqa: F401

    cls = get_model("kivi")
    kw = dict(pretrained=str(tiny_dir), device="cpu", dtype="float32")
    ids = torch.randint(4, 128, (1, 80))
    ref = cls(preset="fp", **kw)
    full = ref.model(ids).logits
    assert torch.allclose(ref._model_call(ids), full, atol=1e-4)
    lm2 = cls(key_bits=2, value_bits=2, group_size=16, residual_length=16, page_size=32, **kw)
    assert lm2.prefill_length(80) == 64 and lm2.new_cache().quant_config.key_bits == 2
    out = lm2._model_call(ids)
    assert out.shape == full.shape
    assert torch.allclose(out[:, :64], full[:, :64], atol=1e-4)  # the prefill is full precision
    assert not torch.allclose(out[:, 64:], full[:, 64:], atol=1e-3)  # streamed positions read 2-bit pages
    lm_tail = cls(key_bits=2, value_bits=2, group_size=16, residual_length=16, page_size=32, stream_tokens=8,
                  chunk=4, **kw)
    assert lm_tail.prefill_length(80) == 72
    assert lm_tail._model_call(ids).shape == full.shape


def test_cli_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kivi_cache.lm_eval", "run", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--model_args" in out.stdout


