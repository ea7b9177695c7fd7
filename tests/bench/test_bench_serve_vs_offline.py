import argparse

from bench.serve_vs_offline import ENGINE_SETTINGS, engine_settings, serve_flags
from hetero.cli import build_parser


def test_both_sides_get_the_same_engine_settings():
    args = argparse.Namespace(load_format="dummy", max_num_seqs=64, device="cpu", kv_cache_space=0.5, max_model_len=None)
    settings = engine_settings(args)
    assert settings == {"load_format": "dummy", "max_num_seqs": 64, "device": "cpu", "kv_cache_space": 0.5}
    served = vars(build_parser().parse_args(["serve", "m", *serve_flags(settings)]))
    assert {name: served[name] for name in settings} == settings
    assert set(ENGINE_SETTINGS) <= set(served)
