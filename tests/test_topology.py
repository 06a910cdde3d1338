import pytest
import torch.distributed as dist

from distributed import run_distributed
from megapar.topology import Topology


def test_specs_example_16_ranks():
    t = Topology(tp=2, pp=4, dp=2)
    assert t.tp_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert t.dp_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert t.pp_groups()[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert t.embedding_groups()[:2] == [[0, 12], [1, 13]]
    assert t.coord(13).__dict__ == {"tp": 1, "dp": 0, "pp": 3}
    assert t.next_rank(5) == 9 and t.prev_rank(5) == 1
    assert t.next_rank(13) is None and t.prev_rank(1) is None
    assert t.is_first_stage(3) and t.is_last_stage(14)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (1, 4, 1), (2, 2, 2), (4, 2, 1), (2, 3, 3)])
def test_groups_partition_the_world(tp, pp, dp):
    t = Topology(tp, pp, dp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
        groups = getattr(t, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(t.world_size))
        assert all(len(g) == size for g in groups)
    for r in range(t.world_size):
        c = t.coord(r)
        assert t.rank(c.tp, c.dp, c.pp) == r
        assert t.group_of("tp", r) == [t.rank(i, c.dp, c.pp) for i in range(tp)]


def test_bad_sizes():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        Topology(0, 1, 1)


def _groups_body(rank, world_size):
    t = Topology(tp=2, pp=2, dp=2)
    g = t.create_groups(rank)
    out = {}
    for kind in ("tp", "dp", "pp", "mp", "embedding"):
        group = getattr(g, kind)
        out[kind] = dist.get_process_group_ranks(group)
    return out


@pytest.mark.slow  # --quick skips it (8 processes): the arithmetic is checked above, created groups by the gloo tests
def test_created_groups_match_arithmetic():
    t = Topology(tp=2, pp=2, dp=2)
    results = run_distributed(_groups_body, world_size=8)
    for rank, got in enumerate(results):
        for kind in ("tp", "dp", "pp", "mp", "embedding"):
            assert got[kind] == t.group_of(kind, rank), (rank, kind)


def test_design_doc_lists_every_group_kind():
    """docs/design.md's table of process groups names exactly the fields of Groups, and its count."""
    import dataclasses
    import re
    from pathlib import Path
    from megapar.topology import Groups
    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = doc[doc.index("`Topology` creates"):]
    section = section[:section.index("\n\n", section.index("| group |"))]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    kinds = [f.name for f in dataclasses.fields(Groups)]
    assert listed == kinds
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert f"creates {words[len(kinds) - 1]} kinds of group" in section
