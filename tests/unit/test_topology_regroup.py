"""The topology arithmetic after a death (no MPI): :func:`hpcasync.topology.regroup` keeps every
survivor with the other survivors of its node — nodes become uneven instead of being cut into
nodes of gcd(sizes) ranks (gcd(2, 1) = 1: every node a 1-rank node, DASO without node-local
averaging) — and forms DASO's global groups so that every node is in every group (local rank
j mod L_p of node p), which keeps DASO's merge an average over all P nodes."""
import pytest

from hpcasync.topology import regroup


def sizes(nodes):
    return [len(n) for n in nodes]


def test_uniform_nodes_give_local_index_groups():
    # 3 nodes x 2 ranks, before any death: group j = local index j on every node (topo.glob)
    nodes, groups = regroup([0, 0, 1, 1, 2, 2])
    assert nodes == [[0, 1], [2, 3], [4, 5]]
    assert groups == [[0, 2, 4], [1, 3, 5]]


def test_one_death_keeps_the_other_ranks_of_each_node_together():
    # 3 nodes x 2, old rank 3 dead: the survivors (new ranks 0..4) report their old node
    nodes, groups = regroup([0, 0, 1, 2, 2])
    assert nodes == [[0, 1], [2], [3, 4]]
    assert sizes(nodes) == [2, 1, 2]               # not [1, 1, 1, 1, 1] (gcd(2, 1, 2) = 1)
    # the lone rank of node 1 stands for its node in both groups
    assert groups == [[0, 2, 3], [1, 2, 4]]


def test_two_nodes_of_two_minus_one():
    nodes, groups = regroup([0, 1, 1])              # old rank 1 of node 0 dead
    assert nodes == [[0], [1, 2]] and groups == [[0, 1], [0, 2]]


def test_node_ids_need_not_be_consecutive_and_a_lost_node_disappears():
    # old node 1 lost both ranks; nodes are renumbered by their lowest surviving rank
    nodes, groups = regroup([2, 0, 0, 2, 3, 3, 3])
    assert nodes == [[0, 3], [1, 2], [4, 5, 6]]
    assert sizes(nodes) == [2, 2, 3]
    assert groups == [[0, 1, 4], [3, 2, 5], [0, 1, 6]]


@pytest.mark.parametrize("node_of", [[0, 0, 1, 2, 2], [0, 1, 1], [0, 0, 0, 1, 2, 2],
                                     [5, 5, 5, 5, 7], [0, 1, 2]])
def test_every_group_has_one_rank_of_every_node_and_every_rank_is_in_a_group(node_of):
    nodes, groups = regroup(node_of)
    assert sorted(r for n in nodes for r in n) == list(range(len(node_of)))
    assert len(groups) == max(sizes(nodes))
    node_index = {r: p for p, n in enumerate(nodes) for r in n}
    for g in groups:
        assert [node_index[r] for r in g] == list(range(len(nodes)))
    assert set().union(*map(set, groups)) == set(range(len(node_of)))


def test_daso_weights_on_uneven_nodes():
    """What DASO computes over these groups: with each node's replicas identical (node-local
    averaging), a global group's sum S holds each node's replica once, for every group, so
    the merge (2B·x + S)/(2B + P) weighs every node 1 with P = number of nodes; the blocking
    average is over ranks (a node weighs its rank count), as the epoch-end average over all
    replicas."""
    node_of = [0, 0, 1, 2, 2]
    nodes, groups = regroup(node_of)
    value = {0: 1.0, 1: 10.0, 2: 100.0}                        # node p's replica
    replica = [value[n] for n in node_of]                      # per (new) rank
    for g in groups:
        assert sum(replica[r] for r in g) == 111.0             # S: every node once
    leaders = groups[0]
    assert leaders == [n[0] for n in nodes]
    node_sums = [sum(replica[r] for r in n) for n in nodes]    # node allreduce
    assert sum(node_sums) / len(node_of) == sum(replica) / len(replica)   # over all ranks


def test_empty_world():
    assert regroup([]) == ([], [])
