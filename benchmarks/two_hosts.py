"""The several-machines launch (docs/scaling.md) between two network namespaces.

Two Linux network namespaces joined by a veth pair stand in for two machines: each
has its own network stack, interface and address (10.231.0.1 and 10.231.0.2), and
runs one torchrun agent with one rank (`--nnodes 2 --nproc-per-node 1`, a c10d
rendezvous at host 0's address, gloo bound to the host's interface). Nothing
between them goes over loopback: the rendezvous, the configuration check, the
gradient sums (and, under FP8 attention flows, the Q/K/V calibration) all cross the
veth link, whose byte counters say how much. `--rate` caps each direction of the link with a token bucket
(`tc qdisc ... tbf`) to look like a network between machines (this kernel has no
netem, so no added latency).

The same run (the default config's batch, as `data_parallel.py`: tiny-arith, 16
prompts x 8 samples, 2 micro-batches, 2 gradient chunks) is trained in one process
with both cores, then across the two hosts with one core each; the first step is a
warm-up, the mean of the others is reported, and the runs are compared bit for bit
(metrics apart from timings, the final weights).

What it is not: two machines. The namespaces share one kernel, one file system
(the run directory, as a shared file system would be) and the two cores. It
needs root (`ip netns`, `tc`) and removes what it made, also on failure.

    sudo python benchmarks/two_hosts.py                           # 5 steps, an unshaped link
    sudo python benchmarks/two_hosts.py --rate 1gbit               # a 1 Gbit/s link

JSON on stdout, a table on stderr. Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from data_parallel import same_run  # benchmarks/ is on sys.path when a script here runs
from vs_trl import cpu_name

from fp8rl.fp8.backends import amx_available

HOSTS = (("fp8rl-host0", "fp8rl-veth0", "10.231.0.1"), ("fp8rl-host1", "fp8rl-veth1", "10.231.0.2"))
PORT = 29500
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.toml"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def make_hosts(rate: str | None) -> None:
    """The two namespaces, the veth pair between them, addresses, and the link's shape."""
    (_, dev0, _), (_, dev1, _) = HOSTS
    for ns, _, _ in HOSTS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", dev0, "type", "veth", "peer", "name", dev1)
    for ns, dev, addr in HOSTS:
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate:  # a bucket of 256 KiB; a queue long enough for a step's sums, so nothing is dropped
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", "256kb", "limit", "64mb")


def remove_hosts() -> None:
    for ns, _, _ in HOSTS:  # deleting a namespace deletes its end of the veth pair, hence both
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def link_bytes() -> int:
    """Bytes host 0 has sent plus bytes it has received on its interface."""
    ns, dev, _ = HOSTS[0]
    stats = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", dev))[0]["stats64"]
    return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def train_args(steps: int, flow: str, backend: str, out: Path) -> list[str]:
    return ["-m", "fp8rl", "train", "--config", str(CONFIG), "--out", str(out), "--steps", str(steps),
            "--flow", flow, "--backend", backend, "--no-progress", "--set", "eval.n=0",
            "--set", f"checkpoint.every={steps}"]


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], wall: float) -> dict:
    timed = rows[1:]
    mean = lambda k: sum(r[k] for r in timed) / len(timed)  # noqa: E731
    return {"wall_s": wall, "step_s": mean("time_step_s"), "rollout_s": mean("time_rollout_s"),
            "train_s": mean("time_train_s")}


def one_process(steps: int, flow: str, backend: str, out: Path) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *train_args(steps, flow, backend, out)], check=True, stdout=subprocess.DEVNULL)
    return metric_rows(out), time.perf_counter() - t0


def two_hosts(steps: int, flow: str, backend: str, out: Path, timeout: float) -> tuple[list[dict], float]:
    """One torchrun agent per namespace; both must exit 0 within `timeout` seconds (else
    both are killed)."""
    host0 = HOSTS[0][2]
    agents, t0 = [], time.perf_counter()
    for i, (ns, dev, addr) in enumerate(HOSTS):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host0}:{PORT}",
               "--rdzv-id", "two-hosts", "--rdzv-conf", f"is_host={i == 0}", "--local-addr", addr,
               *train_args(steps, flow, backend, out)]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        errors = [agent.communicate(timeout=max(1.0, t0 + timeout - time.perf_counter()))[1] for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
        raise SystemExit(f"the two-host run took over {timeout:.0f} s; both agents killed") from None
    wall = time.perf_counter() - t0
    if any(agent.returncode for agent in agents):
        raise SystemExit("a host's torchrun failed:\n" + "\n".join(e[-2000:] for e in errors))
    return metric_rows(out), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--flow", default="jet")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rate", default=None, help="cap of each direction of the link, e.g. 1gbit (default: none)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the two-host run may take")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("two_hosts.py makes network namespaces: run it as root")
    remove_hosts()  # leftovers of an interrupted run
    with tempfile.TemporaryDirectory() as tmp:
        rows_one, wall_one = one_process(args.steps, args.flow, args.backend, Path(tmp) / "one")
        try:
            make_hosts(args.rate)
            before = link_bytes()
            rows_two, wall_two = two_hosts(args.steps, args.flow, args.backend, Path(tmp) / "two", args.timeout)
            moved = link_bytes() - before
        finally:
            remove_hosts()
        equal = same_run(Path(tmp) / "one", Path(tmp) / "two", rows_one, rows_two, args.steps)
    one, two = summary(rows_one, wall_one), summary(rows_two, wall_two)
    two |= {"link_bytes": moved, "link_bytes_per_step": moved / args.steps, "speedup": one["step_s"] / two["step_s"],
            "bitwise_equal_to_one_process": equal}
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "amx": amx_available(),
              "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(), "torch": torch.__version__,
              "flow": args.flow, "backend": args.backend, "steps": args.steps, "steps_timed": args.steps - 1,
              "link_rate": args.rate or "uncapped",
              "one_process": one, "two_hosts": two}
    print(f"{'run':>12} {'s/step':>8} {'rollout':>8} {'train':>8} {'wall s':>8} {'MB/step':>8} {'speedup':>8} "
          f"{'bitwise':>8}", file=sys.stderr)
    print(f"{'1 process':>12} {one['step_s']:>8.2f} {one['rollout_s']:>8.2f} {one['train_s']:>8.2f} "
          f"{one['wall_s']:>8.1f}", file=sys.stderr)
    print(f"{'2 hosts':>12} {two['step_s']:>8.2f} {two['rollout_s']:>8.2f} {two['train_s']:>8.2f} "
          f"{two['wall_s']:>8.1f} {two['link_bytes_per_step'] / 1e6:>8.2f} {two['speedup']:>7.2f}x "
          f"{str(equal):>8}", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
