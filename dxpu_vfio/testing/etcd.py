"""etcd for the pool tests: one member for the session (tests share it under key
prefixes of their own), three for a test that kills members; members are ended by pid.
And ``stores``: two handles on one pool, on SQLite and on etcd."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster

_ids = itertools.count(1)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator["EtcdCluster"]:
    """One etcd member for the session, on free ports, data under tmp; tests share it by
    using a key prefix of their own (``etcd_prefix``). Members run with ``ETCD_*``
    scrubbed and are ended by pid (dxpu_vfio.pool.etcd_cluster)."""
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd1"), members=1).start()
    yield cluster
    cluster.stop()
    assert not any(m.alive() for m in cluster.members), "an etcd member outlived the session"


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, so tests share one etcd without seeing each other."""
    return f"/dxpu-test/{next(_ids)}-{re.sub(r'[^A-Za-z0-9]+', '-', request.node.name)[:60]}/v1/"


@pytest.fixture(params=["sqlite", "etcd"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list]:
    """Two handles on one pool, as two hosts (or a manager and a host agent) hold them:
    one SQLite file opened twice, or two clients of the session's etcd under this test's
    prefix. A test taking ``stores`` runs on both stores."""
    from dxpu_vfio.pool.etcd_store import EtcdStore
    from dxpu_vfio.pool.store import Store
    if request.param == "sqlite":
        handles = [Store(tmp_path / "pool.db"), Store(tmp_path / "pool.db")]
    else:
        cluster, prefix = request.getfixturevalue("etcd"), request.getfixturevalue("etcd_prefix")
        handles = [EtcdStore(cluster.endpoints, path=tmp_path / f"h{i}.db", prefix=prefix) for i in (1, 2)]
    yield handles
    for handle in handles:
        handle.close()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator["EtcdCluster"]:
    """A three-member cluster of this test alone (tests kill members of it)."""
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster
    cluster = EtcdCluster(tmp_path / "etcd3", members=3).start()
    yield cluster
    cluster.stop()
