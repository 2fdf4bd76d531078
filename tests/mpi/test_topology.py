"""Topology: node-local and global groups, virtual nodes, errors for worlds that do not fit."""
import pytest

from hpcasync.errors import TopologyError
from hpcasync.topology import Topology, pick_device
from tests.mpi_util import COMM, RANK, SIZE, run_mpi


@pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")
def test_two_virtual_nodes_of_two():
    topo = Topology.build(ranks_per_node=2)
    try:
        assert (topo.num_nodes, topo.local_size, topo.uniform) == (2, 2, True)
        assert topo.node == RANK // 2 and topo.local_rank == RANK % 2
        # node-local group: the two consecutive ranks; global group: same local index on each node
        assert topo.local.allgather(RANK) == [2 * topo.node, 2 * topo.node + 1]
        assert topo.glob.allgather(RANK) == [topo.local_rank, topo.local_rank + 2]
        assert topo.glob.Get_size() == topo.num_nodes
    finally:
        topo.free()


def test_physical_node_holds_everyone():
    topo = Topology.build()
    try:
        assert topo.num_nodes == 1 and topo.local_size == SIZE and topo.glob.Get_size() == 1
        assert topo.device == "cpu" or topo.device.startswith("cuda:")
        assert topo.workers == [r for r in range(SIZE) if r != 0]
    finally:
        topo.free()


@pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")
def test_world_that_does_not_fit_raises_on_every_rank():
    with pytest.raises(TopologyError, match="multiple of --ranks-per-node"):
        Topology.build(ranks_per_node=3)


def test_bad_ps_rank_and_device():
    with pytest.raises(TopologyError, match="ps rank"):
        Topology.build(ps_rank=SIZE)
    with pytest.raises(TopologyError, match="--device"):
        pick_device("tpu", 0)
    assert pick_device("cpu", 3) == "cpu"
