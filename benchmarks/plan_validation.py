"""Does ``tandem plan`` predict what ``tandem bench`` measures? Real clusters on this machine,
simulated and measured side by side, and a goodput-against-rate sweep of a disaggregated
topology against a colocated one on the same cores, the planner's curves on the same axes.

For each topology (``tandem up`` of the 30M benchmark model, fixed KV blocks):

1. calibrate: a short ``tandem bench`` run warms the cluster while ``tandem plan
   --from-cluster --watch`` reads its workers' steps from the registry and saves a profile;
2. for each rate: ``tandem plan --profile ... --evaluate`` predicts, then ``tandem bench``
   measures the same workload (the same seeded prompts and Poisson arrivals);
3. ``tandem down``.

Printed: the machine, a table of predicted against measured goodput and p90 TTFT with the
error of each, and the sweep; plotted: ``benchmarks/results/plan_validation_sweep.png``.

    .venv/bin/python benchmarks/plan_validation.py          # about 10 minutes on a 2-core CPU
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

from common import REPO_ROOT, ensure_checkpoint, machine_rows, print_table

from cluster.bench.report import plot_sweep  # noqa: E402

TANDEM = [str(Path(sys.executable).parent / "tandem")]
RESULTS = REPO_ROOT / "benchmarks" / "results"
TOPOLOGIES = {  # name: pools (the same two cores for each)
    "1P+1D": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    "2C": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {"replicas": 2}},
    "1C": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {"replicas": 1}},
}


def tandem(args: list[str], env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([*TANDEM, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"tandem {args[0]} failed ({result.returncode}): {result.stderr.strip()[-1500:]}")
    return result


def write_topology(path: Path, name: str, pools: dict, model_dir: Path, args) -> None:
    topology = {"cluster": {"name": name}, "model": {"path": str(model_dir)}, "server": {"port": 0, "http_port": 0},
                "kv": {"num_blocks": args.kv_blocks}, "ray": {"num_cpus": 2}}
    for role in ("prefill", "decode", "colocated"):
        topology[role] = {"max_num_seqs": args.max_num_seqs, **pools.get(role, {})}
    path.write_text(json.dumps(topology))


def workload_flags(args, index: int) -> list[str]:
    """The workload at the ``index``-th rate: fresh prompts for each (a run must not hit the
    prefix cache the runs before it filled: the simulator starts each run with empty caches)."""
    return ["--num-requests", str(args.requests), "--input-len", args.input_len, "--output-len", args.output_len,
            "--goodput", f"ttft_ms:{args.ttft_ms:g}", f"tpot_ms:{args.tpot_ms:g}", "--seed",
            str(args.seed + 1000 * index), "--duration", str(args.duration)]


def figures(summary: dict) -> dict:
    return {"goodput": summary["goodput"]["goodput_rps"], "attainment": summary["goodput"]["attainment"],
            "ttft_p90": summary["ttft"]["p90_ms"], "tpot_p90": summary["tpot"]["p90_ms"]}


def run_topology(label: str, pools: dict, rates: list[float], model_dir: Path, work: Path, env: dict, args) -> dict:
    name = f"h-val-{label.lower().replace('+', '')}"
    topology = work / f"{name}.yaml"
    write_topology(topology, name, pools, model_dir, args)
    print(f"[bench] {label}: starting the cluster", file=sys.stderr, flush=True)
    tandem(["up", "--topology", str(topology), "--detach"], env)
    out = {"rates": {}}
    try:
        profile = work / f"{name}-profile.json"
        watcher = subprocess.Popen([*TANDEM, "plan", "--from-cluster", name, "--watch", str(args.calibrate_s),
                                    "--save-profile", str(profile), "--evaluate", "--rate", "1", "--num-requests",
                                    "1", "--quiet"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        print(f"[bench] {label}: calibrating ({args.calibrate_s:g}s)", file=sys.stderr, flush=True)
        tandem(["bench", "--cluster", name, "--rate", str(args.calibrate_rate), "--seed", "999",
                "--num-requests", str(10_000), "--duration", str(args.calibrate_s - 2), "--input-len",
                args.input_len, "--output-len", args.output_len, "--quiet"], env)
        _, err = watcher.communicate(timeout=600)
        if watcher.returncode != 0:
            sys.exit(f"tandem plan --from-cluster failed: {err.strip()[-1500:]}")
        for index, rate in enumerate(rates):
            predicted = work / f"{name}-{rate:g}-plan.json"
            tandem(["plan", "--profile", str(profile), "--topology", str(topology), "--evaluate", "--rate", str(rate),
                    "--json", str(predicted), "--quiet", *workload_flags(args, index)], env)
            prediction = json.loads(predicted.read_text())["predictions"][0]
            measured = work / f"{name}-{rate:g}-bench.json"
            print(f"[bench] {label}: measuring at {rate:g} req/s", file=sys.stderr, flush=True)
            tandem(["bench", "--cluster", name, "--rate", str(rate), "--json", str(measured), "--quiet",
                    *workload_flags(args, index)], env)
            summary = json.loads(measured.read_text())["rates"][0]["summary"]
            out["rates"][rate] = {"predicted": {"goodput": prediction["goodput_rps"],
                                                "attainment": prediction["attainment"],
                                                "ttft_p90": prediction["ttft_p90_ms"],
                                                "tpot_p90": prediction["tpot_p90_ms"]},
                                  "measured": figures(summary)}
    finally:
        subprocess.run([*TANDEM, "down", "--cluster", name], env=env, capture_output=True, timeout=300)
    return out


def error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or measured == 0:
        return "-"
    return f"{(predicted - measured) / measured:+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep-rates", default="1,2,3,4", help="rates of the 1P+1D and 2C sweep")
    parser.add_argument("--rates-1c", default="1,2", help="rates of the 1C topology")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--input-len", default="32-256")
    parser.add_argument("--output-len", default="16-48")
    parser.add_argument("--ttft-ms", type=float, default=800.0)
    parser.add_argument("--tpot-ms", type=float, default=80.0)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--calibrate-s", type=float, default=25.0)
    parser.add_argument("--calibrate-rate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir, params = ensure_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="tandem-plan-validation-"))
    env = {**os.environ, "TANDEM_CACHE_DIR": str(work / "cache")}
    sweep = [float(r) for r in args.sweep_rates.split(",")]
    plan = {"1P+1D": sweep, "2C": sweep, "1C": [float(r) for r in args.rates_1c.split(",")]}
    started = time.perf_counter()
    results = {label: run_topology(label, TOPOLOGIES[label], rates, model_dir, work, env, args)
               for label, rates in plan.items()}

    print_table("machine", machine_rows() + [
        ("model", f"random Llama, {params / 1e6:.0f}M parameters, float32, 1 thread per worker"),
        ("workload", f"synthetic input {args.input_len}, output {args.output_len}, {args.requests} requests, "
                     f"Poisson; objectives TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms"),
        ("run time", f"{time.perf_counter() - started:.0f}s")])
    rows = []
    within = total = 0
    for label, out in results.items():
        for rate, r in out["rates"].items():
            p, m = r["predicted"], r["measured"]
            rows.append((label, f"{rate:g}", f"{p['goodput']:.2f}", f"{m['goodput']:.2f}",
                         error(p["goodput"], m["goodput"]), f"{p['attainment']:.0%}", f"{m['attainment']:.0%}",
                         f"{p['ttft_p90']:.0f}", f"{m['ttft_p90']:.0f}", error(p["ttft_p90"], m["ttft_p90"])))
            for a, b in ((p["goodput"], m["goodput"]), (p["ttft_p90"], m["ttft_p90"])):
                total += 1
                within += b not in (None, 0) and a is not None and abs(a - b) / b <= 0.2
    print_table("simulated (tandem plan) vs measured (tandem bench)", rows,
                ("topology", "rate req/s", "goodput sim", "goodput real", "error", "attain sim", "attain real",
                 "TTFT p90 sim ms", "TTFT p90 real ms", "error"))
    print(f"\ngoal: within 20%: {within} of {total} figures")
    measured = {label: [(rate, r["measured"]["goodput"], r["measured"]["attainment"])
                        for rate, r in results[label]["rates"].items()] for label in ("1P+1D", "2C")}
    predicted = {label: [(rate, r["predicted"]["goodput"], r["predicted"]["attainment"])
                         for rate, r in results[label]["rates"].items()] for label in ("1P+1D", "2C")}
    path = plot_sweep(RESULTS / "plan_validation_sweep.png", measured, predicted,
                      f"disaggregated 1P+1D vs colocated 2C on {os.cpu_count()} cores, 30M model: measured "
                      f"(tandem bench) and predicted (tandem plan)")
    (RESULTS / "plan_validation.json").write_text(json.dumps(results, indent=1))
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
