"""Two torchrun nodes on this machine, each in mount and UTS namespaces of its own (unshare -m -u): its own
hostname, and its own /etc/hosts bind-mounted in. Node 0's /etc/hosts says what Ubuntu and cloud-init
write (`127.0.1.1 node0`), node 1's resolves node0 to 127.0.0.1 (on a cluster: node 0's network address).
torchrun's c10d rendezvous then gives every rank MASTER_ADDR=node0, node 0's name, as on a cluster: node 0
resolves it to 127.0.1.1, node 1 to 127.0.0.1. Trainer rank 0 runs on node 0, the rollout rank on node 1
(on the plain-torch engine, --engine torch: what crosses the nodes is the rank's, the queues and the
weight-sync group, not the engine's). torchrun's TCPStore listens on every interface, so torch starts either
way; the run passes only if node 1's rollout rank reaches the queue server that node 0 serves and takes the
weights that node 0 broadcasts. (What one machine cannot show: gloo and NCCL pick their own interface from
the hostname, loopback here; on a cluster set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, README.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import kill_tree
from tools.jobs import free_port_pair

ROOT = Path(__file__).resolve().parent.parent
HOSTS = {0: "127.0.0.1 localhost\n127.0.1.1 node0\n",
         1: "127.0.0.1 localhost\n127.0.1.1 node1\n127.0.0.1 node0\n"}


def in_node(node: int, hosts: Path, *cmd: str) -> list[str]:
    """cmd in node `node`'s namespaces: hostname node<node>, `hosts` as /etc/hosts."""
    inner = f"mount --bind {hosts} /etc/hosts && hostname node{node} && exec \"$@\""
    return ["unshare", "-m", "-u", "sh", "-c", inner, "sh", *cmd]


def namespaces_work() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-m", "-u", "sh", "-c", "hostname probe && mount --bind /dev/null "
                        "/dev/null && hostname"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and r.stdout.strip() == "probe"


@pytest.mark.skipif(not namespaces_work(), reason="needs root and unshare (mount and UTS namespaces)")
def test_two_nodes_c10d_rendezvous_where_node0_resolves_its_name_to_127_0_1_1(tmp_path, tiny_model_dir):
    hosts = {}
    for node, text in HOSTS.items():
        hosts[node] = tmp_path / f"hosts{node}"
        hosts[node].write_text(text)
    # the layout this test is about: what each node's rank sees MASTER_ADDR=node0 as
    see = "import socket; print(socket.getfqdn(), socket.gethostbyname('node0'))"
    seen = [subprocess.run(in_node(n, hosts[n], sys.executable, "-c", see), capture_output=True, text=True,
                           timeout=60).stdout.split() for n in (0, 1)]
    assert seen == [["node0", "127.0.1.1"], ["node1", "127.0.0.1"]]
    out, port = tmp_path / "run", free_port_pair()
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{port}", "--rdzv-id", f"t{port}",
                "train.py", "--rollout-gpus", "1", "--train-gpus", "1", "--engine", "torch",
                "--model", str(tiny_model_dir),
                "--out-dir", str(out), "--steps", "1", "--batch-groups", "2", "--group-size", "4",
                "--redundant", "0", "--no-filter-groups", "--max-concurrency", "8", "--check-sync-every", "1",
                "--save-every", "0", "--max-events", "0", "--timeout-s", "120", "--startup-timeout-s", "150"]
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    nodes = [subprocess.Popen(in_node(n, hosts[n], *torchrun), cwd=ROOT, stdout=logs[n],
                              stderr=subprocess.STDOUT, start_new_session=True) for n in (0, 1)]
    try:
        codes = [p.wait(timeout=480) for p in nodes]
    finally:
        for p in nodes:
            kill_tree(p.pid)
        for f in logs:
            f.close()
    text = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], f"node 0:\n{text[0][-2500:]}\nnode 1:\n{text[1][-2500:]}"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # one step: samples came from node 1's engine through the queues, the weights went back to it
    assert [r["step"] for r in rows] == [1] and rows[0]["num_samples"] == 8
    assert rows[0]["sync_probe_max_diff"] < 1e-4
