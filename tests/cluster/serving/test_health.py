"""cluster.serving.health's verdict, from entries in a real Ray's key-value store (the replica directory)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

import cluster.serving.directory
from cluster.serving.directory import Directory
from cluster.serving.health import INGRESS_STALE_S, verdict

APP = "health-test"
_apps = itertools.count()


@pytest.fixture
def directory(ray_cluster) -> Directory:
    return Directory(f"{APP}-{next(_apps)}")  # each test its own application: no entries left by another


def test_healthy_only_while_an_ingress_replica_publishes_no_problem(directory):
    assert verdict(directory) == f"no ingress replica has answered in the last {INGRESS_STALE_S:.0f} s"
    directory.publish("ingress", "a", None, {"in_flight": 0}, 1)
    assert verdict(directory) is None
    directory.publish("ingress", "a", None, {"in_flight": 0}, 2, problem="the server is shutting down")
    assert verdict(directory) == "the server is shutting down"


def test_each_problem_of_every_live_ingress_is_named_once(directory):
    decode_gone, worker_gone = "the decode role has no live replica", "postproc worker 1 is dead"
    directory.publish("ingress", "a", None, {}, 1, problem=decode_gone)
    directory.publish("ingress", "b", None, {}, 1, problem=f"{decode_gone}; {worker_gone}")
    directory.publish("ingress", "c", None, {}, 1, problem=decode_gone)
    directory.publish("ingress", "d", None, {}, 1)
    assert verdict(directory) == f"{decode_gone}; {worker_gone}"


def test_an_ingress_that_stopped_refreshing_counts_as_gone(directory, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(cluster.serving.directory, "time", SimpleNamespace(monotonic=lambda: now[0]))  # its clock alone
    directory.publish("ingress", "a", None, {}, 1)
    directory.publish("ingress", "b", None, {}, 1, problem="the prefill role has no live replica")
    assert verdict(directory) == "the prefill role has no live replica"
    now[0] += INGRESS_STALE_S - 1  # a flood holds both loops up a while: not yet gone
    directory.publish("ingress", "a", None, {}, 2)
    assert verdict(directory) == "the prefill role has no live replica"
    now[0] += 2  # b has not moved for longer than INGRESS_STALE_S: its problem goes with it
    assert verdict(directory) is None
    now[0] += INGRESS_STALE_S
    assert verdict(directory).startswith("no ingress replica has answered")
