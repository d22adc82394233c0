"""A 2-node Ray cluster on this machine (`ray start --head` plus a second `ray start --address`), joined by the real
CLI through --ray-address: the dataset equals the local pool's for the same plan, byte for byte. Slow (~1 min: two
Ray nodes start), and it stops every Ray process on the machine at the end, so it has a module of its own."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vlmprep.conftest import TOOLS, tree_hashes

pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_two_node_ray_cluster_writes_the_local_pool_bytes(task_traces, local3, tmp_path):
    ref, _ = local3
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    address = f"127.0.0.1:{_free_port()}"

    def ray(*args):
        proc = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    ray(
        "start",
        "--head",
        f"--port={address.split(':')[1]}",
        "--num-cpus=1",
        "--include-dashboard=false",
        "--disable-usage-stats",
    )
    try:
        ray("start", f"--address={address}", "--num-cpus=1")
        nodes = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ray; ray.init(address={address!r}); print(sum(n['Alive'] for n in ray.nodes()))",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert nodes.stdout.strip().splitlines()[-1] == "2", nodes.stderr[-2000:]
        out = tmp_path / "ds"
        cmd = [
            sys.executable,
            "-m",
            "vlmprep",
            "build",
            "--in",
            task_traces,
            "--out",
            out,
            "--tasks",
            "3",
            "--executor",
            "ray",
            "--ray-address",
            address,
            "--processor",
            "tiny:qwen2-vl",
            "--seq-len",
            "2048",
            "--samples-per-shard",
            "2",
            "--chat-template",
            TOOLS,
            "--no-progress",
            "--max-reject-fraction",
            "1",
            "--min-turn-coverage",
            "0",
        ]
        built = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr[-3000:]
        assert tree_hashes(out) == tree_hashes(ref)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
