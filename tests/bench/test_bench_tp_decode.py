import pytest

from bench.tp_decode import parse_configs


def test_configs_name_a_size_and_an_all_reduce():
    assert parse_configs("1:nccl,2:nccl,2:one-shot") == [(1, "nccl"), (2, "nccl"), (2, "one-shot")]
    with pytest.raises(ValueError, match="'2:custom'"):
        parse_configs("2:custom")
