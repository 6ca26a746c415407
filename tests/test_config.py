import pytest
import torch

from kivi_cache import Int2PagedCache, Int4PagedCache, QuantConfig, QuantizedPagedCache, set_backend

BAD = [
    ("key_bits", 3, r"key_bits must be one of \(2, 4, 8\)"),
    ("key_bits", 16, r"key_bits must be one of \(2, 4, 8\)"),
    ("key_bits", True, r"key_bits must be one of"),
    ("key_bits", "4", r"key_bits must be one of"),
    ("value_bits", 1, r"value_bits must be one of \(2, 4, 8\)"),
    ("value_bits", 4.0, r"value_bits must be one of"),
    ("group_size", 0, r"group_size must be an integer >= 1"),
    ("group_size", 16.5, r"group_size must be an integer >= 1"),
    ("residual_length", -1, r"residual_length must be an integer >= 0"),
    ("page_size", 0, r"page_size must be an integer >= 1"),
    ("page_size", 48, r"page_size must be a multiple of group_size \(32\)"),
    ("num_pages", -2, r"num_pages must be an integer >= 0"),
    ("sink_length", -1, r"sink_length must be an integer >= 0"),
]


@pytest.mark.parametrize("name,value,msg", BAD)
def test_invalid_values_name_parameter_and_allowed_values(name, value, msg):
    with pytest.raises(ValueError, match=msg):
        QuantConfig(**{name: value})
    with pytest.raises(ValueError, match=msg):
        QuantizedPagedCache(**{name: value})


def test_presets_defaults_and_overrides():
    c4, c2 = Int4PagedCache(), Int2PagedCache(residual_length=64)
    assert (c4.quant_config.key_bits, c4.quant_config.value_bits, c4.quant_config.group_size,
            c4.quant_config.residual_length, c4.quant_config.sink_length) == (4, 4, 32, 128, 4)
    assert (c2.quant_config.key_bits, c2.quant_config.value_bits, c2.quant_config.group_size,
            c2.quant_config.residual_length) == (4, 2, 64, 64)
    with pytest.raises(ValueError, match="key_bits"):
        Int4PagedCache(key_bits=5)


def test_head_dim_not_divisible_by_group_fails_at_first_update_without_state():
    cache = QuantizedPagedCache(group_size=32, page_size=64)
    k = torch.randn(1, 2, 5, 48)
    with pytest.raises(ValueError, match=r"group_size=32 must divide the model's head_dim=48"):
        cache.update(k, k, 0)
    assert len(cache.layers) == 0 and cache.get_seq_length() == 0


@pytest.mark.parametrize("k,v,msg", [
    (torch.randn(2, 5, 32), torch.randn(2, 5, 32), r"key_states must be a 4-d tensor, got \[2, 5, 32\]"),
    (torch.randn(1, 2, 5, 32), None, r"value_states must be a 4-d tensor, got NoneType"),
    (torch.randn(1, 2, 5, 32), torch.randn(1, 2, 4, 32), r"same batch size and number of tokens"),
    (torch.randn(1, 2, 5, 32), torch.randn(2, 2, 5, 32), r"same batch size and number of tokens"),
    (torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32, device="meta"), r"both must be on one device"),
])
def test_update_states_checked_before_any_state_changes(k, v, msg):
    cache = QuantizedPagedCache(group_size=32, page_size=64)
    with pytest.raises(ValueError, match=msg):
        cache.update(k, v, 0)
    assert len(cache.layers) == 0 and cache.get_seq_length() == 0
    cache.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)  # an initialized layer checks them too
    with pytest.raises(ValueError, match=msg):
        cache.update(k, v, 0)
    assert cache.get_seq_length() == 5


def test_config_must_be_a_model_config():
    with pytest.raises(ValueError, match=r"config must be the model's configuration .* got str"):
        QuantizedPagedCache(config="abc")


def test_group_smaller_than_a_word_of_value_codes_is_refused():
    # value codes are stored in 32-bit words of consecutive tokens: a group must fill whole words
    with pytest.raises(ValueError, match="group_size must be at least 16 with value_bits=2"):
        QuantizedPagedCache(value_bits=2, group_size=8, page_size=32)
    with pytest.raises(ValueError, match="group_size must be at least 8 with value_bits=4"):
        QuantizedPagedCache(group_size=4, page_size=32)
    QuantizedPagedCache(value_bits=8, group_size=4, page_size=32)  # 4 tokens x 8 bits: one word
    # more than a word but not whole words: refused up front, not at the first flush (a reshape error mid-generation)
    with pytest.raises(ValueError, match="group_size must be a multiple of 16 with value_bits=2"):
        QuantizedPagedCache(value_bits=2, group_size=24, page_size=48)
    with pytest.raises(ValueError, match="group_size must be a multiple of 4 with value_bits=8"):
        QuantizedPagedCache(key_bits=8, value_bits=8, group_size=6, page_size=12)


def test_backend_name_validated():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\)"):
        set_backend("cuda")


def test_model_configs_checked_up_front():
    """Sliding-window models are served (the hook reads each layer's window); chunked attention is refused."""
    from transformers import Llama4TextConfig, MistralConfig, Qwen2Config

    mixed = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    for cfg in (MistralConfig(sliding_window=64), mixed, Qwen2Config(num_hidden_layers=2)):
        QuantizedPagedCache(config=cfg)
    with pytest.raises(ValueError, match="chunked_attention"):
        QuantizedPagedCache(config=Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=16))


@pytest.mark.parametrize("kw,msg", [
    (dict(max_batch_size=2), "max_batch_size and max_cache_len together"),
    (dict(max_cache_len=100), "max_batch_size and max_cache_len together"),
    (dict(max_batch_size=0, max_cache_len=100), r"max_batch_size must be an integer >= 1, got 0"),
    (dict(max_batch_size=2, max_cache_len=2.5), r"max_cache_len must be an integer >= 1, got 2.5"),
    (dict(max_batch_size=2, max_cache_len=100, num_pages=4), "either num_pages"),
])
def test_max_batch_arguments_validated(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Int4PagedCache(**kw)


def test_pages_per_sequence_and_preallocation():
    c = QuantConfig(group_size=32, residual_length=128, page_size=64, sink_length=4)
    # whole 32-token groups beyond the 4 sinks and the 128-token window, in whole pages
    assert [c.pages_per_sequence(n) for n in (0, 132, 163, 164, 228, 1088)] == [0, 0, 0, 1, 2, 15]
    cache = Int4PagedCache(max_batch_size=892, max_cache_len=1088)
    assert cache.quant_config.num_pages == 892 * 15
    with pytest.raises(ValueError, match="max_len must be an integer >= 0"):
        c.pages_per_sequence(-1)


def test_bytes_per_element_and_live_bytes():
    """Bytes per cached element of a quantized token (codes, and scales and zero points over their groups) and the
    bytes of a sequence in one layer: the sinks and the window in the model's dtype, whole groups quantized."""
    assert Int4PagedCache().quant_config.bytes_per_element() == 0.5 + 2 * 2 / 32
    assert Int2PagedCache().quant_config.bytes_per_element() == 0.4375  # 4-bit keys, 2-bit values, groups of 64
    assert QuantConfig(key_bits=8, value_bits=8).bytes_per_element(torch.float32) == 1 + 2 * 4 / 32
    c = QuantConfig(group_size=32, residual_length=128, page_size=64, sink_length=4)
    d, h = 64, 3
    for n, quantized in [(0, 0), (1, 0), (163, 0), (164, 32), (195, 32), (196, 64), (1000, 864)]:
        full = 2 * (n - quantized) * d * 2  # keys and values in float16
        codes = quantized * d * (4 + 4) // 8
        scales_zeros = quantized * 4 * d * 2 // 32  # keys: 2 per channel per group; values: 2 per group per token
        assert c.live_bytes(n, d, torch.float16, num_heads=h) == h * (full + codes + scales_zeros), n
        assert c.live_bytes(n, d, torch.float16) * 8 == c.live_bytes(n, d, torch.float16, num_heads=8)
    assert c.live_bytes(1000, d, torch.float16) - c.live_bytes(1000 - 32, d, torch.float16) == \
        32 * 2 * d * c.bytes_per_element()  # a group more in the pages, the window as long
    for bad, match in [(dict(tokens=-1), "tokens must be an integer >= 0"),
                       (dict(num_heads=0), "num_heads must be an integer >= 1"),
                       (dict(head_dim=48), "must divide the model's head_dim=48"),
                       (dict(dtype=torch.int32), "dtype must be a floating-point torch.dtype")]:
        with pytest.raises(ValueError, match=match):
            c.live_bytes(**dict(dict(tokens=10, head_dim=64, dtype=torch.float16), **bad))
