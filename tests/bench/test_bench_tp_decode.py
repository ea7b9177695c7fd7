import operator
import time

import pytest

from bench.tp_decode import in_own_process, parse_configs


def test_configs_name_a_size_and_an_all_reduce():
    assert parse_configs("1:nccl,2:nccl,2:one-shot") == [(1, "nccl"), (2, "nccl"), (2, "one-shot")]
    with pytest.raises(ValueError, match="'2:custom'"):
        parse_configs("2:custom")


def test_a_configuration_runs_in_a_process_of_its_own_and_a_failed_or_slow_one_is_none():
    """The result comes back from the spawned process; a function that raises there, or one
    still running at the timeout (then killed), gives None instead of holding the run up."""
    started = time.monotonic()
    assert in_own_process(operator.add, ([1], [2]), timeout_s=120) == [1, 2]
    assert in_own_process(int, ("not a number",), timeout_s=120) is None
    assert in_own_process(time.sleep, (60,), timeout_s=2) is None
    assert time.monotonic() - started < 50
