"""Hostlist expressions as Slurm prints them expand to node names and compress back."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_plugin.hostlist import compress, expand
from torchpass_common.errors import SlurmError


@pytest.mark.parametrize(("expr", "names"), [
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,7],ctl", ["n1", "n2", "n7", "ctl"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n5", ["n5"]),
    ("", []),
    ("(null)", []),
])
def test_expand(expr: str, names: list[str]) -> None:
    assert expand(expr) == names


def test_compress_groups_runs_of_numbers() -> None:
    assert compress(["n3", "n1", "n2", "n7", "ctl"]) == "ctl,n[1-3,7]"
    assert compress(["n1", "n3"]) == "n[1,3]"
    assert compress(["n5"]) == "n5"
    assert compress(["gpu09", "gpu10"]) == "gpu[09-10]"


def test_bad_expression_is_a_slurm_error() -> None:
    with pytest.raises(SlurmError, match="hostlist"):
        expand("n[1-3")
    with pytest.raises(SlurmError, match="bad range"):
        expand("n[a-b]")


@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1, max_size=40))
def test_compress_then_expand_round_trips(numbers: set[int]) -> None:
    names = [f"n{i}" for i in numbers]
    assert sorted(expand(compress(names))) == sorted(names)
