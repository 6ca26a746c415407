"""cache_kwargs / cache_arg_name: the keyword that passes a cache, on the installed transformers and by the rules of
earlier versions (``past_key_values`` before 5.24, ``cache`` from 5.24)."""

import sys
import warnings

import pytest
import torch
import transformers
from models import tiny_llama
from packaging.version import Version

import kivi_cache
from kivi_cache import Int4PagedCache, cache_arg_name, cache_kwargs, compat


class Renamed:  # a model of transformers >= 5.24
    def forward(self, input_ids, attention_mask=None, cache=None, **kwargs): ...


class Named:  # a model of transformers < 5.24 (or of remote code that keeps the name)
    def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs): ...


class Unnamed:  # a wrapper whose forward takes anything
    def forward(self, *args, **kwargs): ...


@pytest.mark.parametrize("version", ["5.17.0", "5.23.1", "5.24.0", "5.24.0.dev0", "5.25.0"])
def test_the_name_follows_the_models_forward_then_the_version(monkeypatch, version):
    monkeypatch.setattr(compat, "transformers_version", lambda: Version(version))
    new = Version(version).release >= (5, 24)
    assert cache_arg_name(Renamed()) == "cache"
    assert cache_arg_name(Named()) == "past_key_values"
    assert cache_arg_name(Unnamed()) == ("cache" if new else "past_key_values")
    cache = Int4PagedCache()
    assert cache_kwargs(Unnamed(), cache) == {"cache" if new else "past_key_values": cache}


def test_installed_transformers_takes_the_name_without_a_deprecation():
    """On the installed transformers the name is the one its models' forward declares, and generate with it stores
    the tokens in the cache without a deprecation warning."""
    model = tiny_llama(layers=1)
    installed = Version(transformers.__version__).release >= (5, 24)
    assert compat.transformers_version() == Version(transformers.__version__)
    assert cache_arg_name(model) == ("cache" if installed else "past_key_values")
    cache = Int4PagedCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(torch.randint(1, 128, (1, 10)), attention_mask=torch.ones(1, 10, dtype=torch.long),
                       **cache_kwargs(model, cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() == 12


def test_docstrings_show_the_current_keyword():
    modules = (kivi_cache, sys.modules["kivi_cache.prefill"], sys.modules["kivi_cache.compat"])
    for doc in (*(m.__doc__ for m in modules), kivi_cache.QuantizedPagedCache.__doc__, cache_kwargs.__doc__):
        assert "past_key_values=" not in doc.replace("``past_key_values=``", ""), doc
    for doc in (kivi_cache.__doc__, kivi_cache.QuantizedPagedCache.__doc__):
        assert "generate(ids, cache=" in doc
