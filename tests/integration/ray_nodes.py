"""A Ray cluster of several simulated nodes on this machine (Ray's own multi-node test
cluster, `ray.cluster_utils.Cluster`): a head that runs no workers, where the controller
runs, and worker nodes of 2 CPUs each, every one with its own raylet and object store
(the smallest Ray allows).

Every Ray process stays on 127.0.0.1, and nothing contacts another address. Each node is
given node_ip_address 127.0.0.1, but that alone is not enough: wherever Ray meets a
loopback address (a bootstrap address, a driver's `_node_ip_address`) it replaces it with
the address this host has towards the outside (services.resolve_ip_for_localhost, which
reads the route to 8.8.8.8), and it tries to reach its GCS there. Ray's single-host mode
turns that off and answers 127.0.0.1 instead: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
(ray_constants.ENABLE_RAY_CLUSTER, read when Ray is first imported; the default off
Windows and macOS is 1). tests/conftest.py sets it for the test process and every
process it starts. The nodes then share one address: the controller binds it, and CURVE
is on all the same (the Ray launcher always turns it on).
"""

LOOPBACK = "127.0.0.1"

OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum: nothing of the run goes through it
NODE_CPUS = 2


def why_no_ray() -> str:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'flexmarl[ray]')"
    return ""


class RayNodes:
    """`with RayNodes(workers=2) as nodes:` a head and `workers` worker nodes; on leaving,
    every process of the cluster is stopped (Ray's own shutdown, by the PIDs it started)."""

    def __init__(self, workers: int) -> None:
        self.count = workers

    def __enter__(self) -> "RayNodes":
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, node_ip_address=LOOPBACK))
        try:
            for _ in range(self.count):
                self.add()
        except BaseException:
            self.cluster.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.shutdown()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self):
        """One more worker node, once it has joined."""
        node = self.cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES,
                                     node_ip_address=LOOPBACK)
        self.cluster.wait_for_nodes()
        return node

    def remove(self, node_id: str) -> None:
        """Kills the node's raylet and every process Ray started on it, as a lost host."""
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def worker_node_ids(self) -> set[str]:
        return {n.node_id for n in self.cluster.worker_nodes}
