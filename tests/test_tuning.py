"""kernels/tuning.py: the settings objects (DecodeTuning, QuantTuning, Tuning) and ``parse``. What the settings do to
the kernels: test_decode.py, test_decode_plan.py, test_quantize.py and test_launch.py."""

import pytest

from kivi_cache.kernels import tuning as T


def test_tuning_objects_check_their_fields_and_parse_settings():
    """Frozen, hashable settings (equal ones hash alike: the plan key holds them); bad values refused when made;
    ``parse`` (the benchmarks' ``--tuning``) maps ``field=value`` to fields, family-qualified where ambiguous."""
    assert T.DecodeTuning() == T.DEFAULT.decode and hash(T.DecodeTuning()) == hash(T.DEFAULT.decode)
    assert T.DecodeTuning(vhint=False) != T.DecodeTuning() and T.QuantTuning(split=False) != T.QuantTuning()
    with pytest.raises(AttributeError):
        T.DEFAULT.decode.warps = 2
    for bad in (dict(srcmin=5), dict(vhint="yes"), dict(ksz=1), dict(warps=3), dict(warps=0), dict(step=True),
                dict(rchunk=0), dict(maxnreg=-1), dict(fuse_merge="auto"), dict(fast_launch=0)):
        with pytest.raises(ValueError, match="DecodeTuning"):
            T.DecodeTuning(**bad)
    with pytest.raises(ValueError, match="QuantTuning.warps"):
        T.QuantTuning(warps=6)
    t = T.parse("vhint=0, ksz=1,rchunk=64,fuse_merge=auto,quant.split=0,decode.warps=2")
    assert t.decode == T.DecodeTuning(vhint=False, ksz=True, rchunk=64, warps=2)
    assert t.quant == T.QuantTuning(split=False)
    assert T.parse("fast_launch=off") == T.Tuning(decode=T.DecodeTuning(fast_launch=False),
                                                  quant=T.QuantTuning(fast_launch=False))
    assert T.parse("") is T.DEFAULT and T.parse("maxnreg=auto", t).decode.maxnreg is None
    assert T.overrides(t) == {"decode.warps": 2, "decode.vhint": False, "decode.ksz": True, "decode.rchunk": 64,
                              "quant.split": False}
    for spec, match in (("warps=2", "decode.warps or quant.warps"), ("nope=1", "no field"), ("vhint", "field=value"),
                        ("vhint=maybe", "switch"), ("step=auto", "not an int"), ("srcmin=5", "srcmin")):
        with pytest.raises(ValueError, match=match):
            T.parse(spec)
