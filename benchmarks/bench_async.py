"""Step time of generation apart from training, the tiny task and a mid-size one side by side in one run: a
``flowkit rollout-server`` on one core, the trainer on the other, synchronous (``rollout.max_staleness: 0``) against
one step off (``rollout.max_staleness: 1``), one step off with partial rollouts (``rollout.partial_rollouts``: a
push lands between two tokens of the generation in flight), and today's colocated HF engine (generation and training
in turn on the trainer's core); then the outcome reward of the synchronous and the one-step-off runs (without and
with partial rollouts), paired by seed.

    python benchmarks/bench_async.py [--sizes tiny mid] [--steps 10] [--mid-steps 3] [--warmup 1] [--rounds 2]
                                     [--reward-seeds 0 1 2] [--reward-steps 60] [--reward-only]
                                     [--reward-correction token_tis] [--reward-correction-cap 2]
                                     [--reward-slowed-server 3]

``tiny`` is configs/rlfr_tiny.yaml's RL step (bundled tiny_adder, 16 prompts × 8 samples, 28 new tokens, the binary
outcome reward, lr 5e-5), ``mid`` the TRL race's mid-size job (benchmarks/bench_trl_race.py: a random Qwen2 of 19 M
parameters, 4 prompts × 8 samples, 256 new tokens, long-tailed response lengths, the ``scrambled`` reward, lr 1e-7;
``--mid-prompts`` / ``--mid-new-tokens`` shrink it); both with the flow reward of rlfr_tiny.yaml and its online
update, no offline pretraining. Each size gets its own server, pinned to the first core (``taskset``), this process
to the second, one intra-op thread each. Per size the four variants alternate ``--rounds`` times so that a busy
machine slows all alike; round r seeds all four with r (the same prompts, and per round other samples: a variant
with one seed would time one sample path however many rounds ran). A step's time is the wall time from the end of one step to the end of the next (the weight
push after a step runs in the module's ``on_train_batch_end``, after a callback's, so a callback's own window would
miss it), so ``--warmup`` must be at least 1. Mid-size steps follow their sampled lengths, so the mean step time is
reported beside the median (ratios of both), with each variant's mean response length, the ratio of the mean step
times per mean response token (the colocated engine samples from the trainer's RNG, the server from seeds drawn from
it, so their lengths differ by chance), and the median and mean time a step waits for its rollouts (``time/generate_s``: the whole generation when it is in turn with training, the part
not hidden behind the previous step when it overlaps), each async variant's mean step time over the synchronous one
against the ideal bound max(G, T) / (G + T), and how long each push waited for the server's model (its log's
``waited … s for the model``; printed only). Each part prints its numbers as it ends, with the machine's
1-minute load average at the start and then; the rows go to benchmarks/results/results.csv at the end.

``--reward-seeds`` then trains the tiny job's synchronous server run and its one-step-off run for ``--reward-steps``
steps per seed. Paired by seed: the same seed gives both runs the same prompt order, the same initial flow and the
same trainer RNG, but not the same samples (the server seeds each request from the trainer's RNG, which the
prefetching run draws at other points). It reports each run's mean outcome reward over all steps and over the last
third, and the paired difference (async − sync, mean ± standard error over the seeds) beside the spread of the
synchronous runs over seeds. The mid job has nothing to learn (a random policy, a hash as reward, lr 1e-7), so the
comparison runs on the tiny job only. ``--reward-correction`` trains both runs of the comparison with that
``loss.rollout_correction`` mode (``--reward-correction-cap``: its cap; default the group's), the timed runs keep
none; ``--reward-only`` skips the step times and runs the comparison alone. On an idle machine the tiny job's
generation ends before its training, so no push lands mid-generation and the partial arm equals the plain one;
``--reward-slowed-server LOOPS`` shares the server's core with that many busy loops during the comparison, so that
generation outlasts training and the partial arm trains on rows whose tokens two policy versions sampled (the share
of such rows, ``rollout/mixed_rows``, is printed per arm).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.errors import ConfigError
from flowkit.modules.policy_options import LossOptions, OptimOptions, RolloutOptions, SamplingOptions, UpdateOptions
from flowkit.options import literal_values
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, NetworkOptions, OnlineOptions, ScoringOptions
from flowkit.rl.rollout_correction import CorrectionMode, RolloutCorrection

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
STARTUP_S = 180
SYNC, ASYNC, PARTIAL, COLOCATED = "server sync", "server async k=1", "server async k=1 partial", "colocated hf"
PUSH_WAIT = re.compile(r"waited ([0-9.]+) s for the model")


class StepClock(L.Callback):
    """Wall time between consecutive step ends, and each step's rollout wait, response length and outcome reward."""

    def __init__(self):
        self.ends: list[float] = []
        self.waits: list[float] = []
        self.lengths: list[float] = []
        self.rewards: list[float] = []
        self.mixed_rows: list[float] = []

    def on_train_batch_end(self, trainer, *args):
        self.ends.append(time.perf_counter())
        metrics = trainer.callback_metrics
        self.waits.append(float(metrics["time/generate_s"]))
        self.lengths.append(float(metrics.get("train/response_length", float("nan"))))
        self.rewards.append(float(metrics.get("train/outcome_reward", float("nan"))))
        self.mixed_rows.append(float(metrics.get("rollout/mixed_rows", 0.0)))


def job(size: str, policy: Path | None, prompts: int, new_tokens: int) -> dict:
    """PolicyModule's settings of the ``size`` job (``policy``: the mid-size policy's directory) and its prompts."""
    if size == "tiny":
        return {"outcome_reward": "binary", "sampling": SamplingOptions(num_samples=8, max_new_tokens=28),
                "optim": OptimOptions(lr=5e-5, flow_lr=1e-3), "prompts": 16}
    return {"backbone": str(policy), "outcome_reward": "none",
            "reward_functions": [{"function": "bench_trl_race.scrambled"}],
            "sampling": SamplingOptions(num_samples=8, max_new_tokens=new_tokens),
            "optim": OptimOptions(lr=1e-7, flow_lr=1e-3), "update": UpdateOptions(micro_batch_tokens=2048),
            "prompts": prompts}


def start_server(log: Path, backbone: str, core: int | None = None,
                 timeout_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """A ``flowkit rollout-server`` (HF backend, one intra-op thread, this checkout's code) for ``backbone`` on a
    loopback port the OS picks, pinned to ``core`` (``taskset``) when given, ``--timeout`` ``timeout_s`` (default:
    the server's); returns its process and the address it printed. Also bench_lora_push's server."""
    # on loopback, for this process's trainers alone, one run after another (each takes the channel at once)
    command = [str(Path(sys.executable).parent / "flowkit"), "rollout-server", "--backbone", backbone, "--port", "0",
               "--insecure-no-auth", "--lease", "0.01"]
    if timeout_s is not None:
        command += ["--timeout", str(timeout_s)]
    if core is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(core), *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while "rollout server for" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the rollout server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    line = next(line for line in log.read_text().splitlines() if "rollout server for" in line)
    return process, line.rsplit(" at ", 1)[1]


def run_steps(steps: int, settings: dict, seed: int = 0, **options) -> StepClock:
    """A fresh run of ``steps`` RL steps of the job ``settings`` (``options``: the rollout variant)."""
    L.seed_everything(seed)
    flow = FlowReward(latents=LatentOptions(percentiles=(0.25,), condition="previous"), network=NetworkOptions(depth=2),
                      scoring=ScoringOptions(timesteps=(0.9,), eta=0.6, beta=0.01, normalization="minmax"),
                      online=OnlineOptions(rejection_metric="correct", kappa=32))
    settings = dict(settings)
    prompts = settings.pop("prompts")
    module = PolicyModule(reward_model=flow, **settings, **options)
    clock = StepClock()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        limit_val_batches=0)
    trainer.fit(module, datamodule=RolloutDataModule(val_path=None, batch_size=prompts))
    return clock


def variants(url: str) -> dict[str, dict]:
    server = RolloutOptions(engine="server", server_url=url, server_timeout=600.0)
    return {COLOCATED: {}, SYNC: {"rollout": server}, ASYNC: {"rollout": replace(server, max_staleness=1)},
            PARTIAL: {"rollout": replace(server, max_staleness=1, partial_rollouts=True)}}


def time_size(url: str, server_log: Path, settings: dict, steps: int, warmup: int,
              rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per variant, over all rounds: step times, rollout waits and response lengths of the steps after ``warmup``, and
    every push's wait for the server's model (from ``server_log``)."""
    measured = {name: {"times": [], "waits": [], "lengths": [], "push_waits": []} for name in variants(url)}
    for round_ in range(rounds):
        for name, options in variants(url).items():
            logged = len(server_log.read_text())
            clock = run_steps(warmup + steps, settings, seed=round_, **options)
            measured[name]["push_waits"] += [float(wait) for wait in PUSH_WAIT.findall(server_log.read_text()[logged:])]
            measured[name]["times"] += [b - a for a, b in zip(clock.ends[warmup - 1:], clock.ends[warmup:])]
            measured[name]["waits"] += clock.waits[warmup:]
            measured[name]["lengths"] += clock.lengths[warmup:]
    return measured


def compare_rewards(url: str, settings: dict, seeds: list[int], steps: int,
                    correction: RolloutCorrection) -> tuple[dict[int, dict[str, list[float]]], dict[str, float]]:
    """Per seed, the synchronous and the one-step-off runs' (without and with partial rollouts) outcome reward at every
    step, all trained with ``correction`` as ``loss.rollout_correction`` (the same for all, so that the pairing stays
    fair); and per run kind, the mean share of a step's rows whose tokens came from two policy versions."""
    options = variants(url)
    loss = LossOptions(rollout_correction=correction)
    clocks = {seed: {name: run_steps(steps, settings, seed, **options[name], loss=loss)
                     for name in (SYNC, ASYNC, PARTIAL)} for seed in seeds}
    mixed = {name: statistics.mean(share for by_name in clocks.values() for share in by_name[name].mixed_rows)
             for name in (SYNC, ASYNC, PARTIAL)}
    return {seed: {name: clock.rewards for name, clock in by_name.items()} for seed, by_name in clocks.items()}, mixed


@contextmanager
def busy_core(core: int, loops: int):
    """``loops`` busy Python processes pinned to ``core`` while the block runs: a server there gets about
    1 / (loops + 1) of it, so its generation outlasts the trainer's step and weight pushes land mid-generation."""
    hogs = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
            for _ in range(loops)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)


def correction_label(correction: RolloutCorrection) -> str:
    return "none" if correction.mode is None else f"{correction.mode}, cap {correction.upper:g}"


def load_span(start: float) -> str:
    """The machine's 1-minute load average at the start of the run and now."""
    return f"{start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"


def report_times(size: str, label: str, measured: dict, load: str) -> list[dict]:
    """Prints the step times of one size and returns its CSV rows."""
    from bench_rl_step import quantiles

    print(f"{size}: load average (1 min) {load}")
    summary, rows = {}, []
    for name, values in measured.items():
        stats = {**quantiles(values["times"]), "mean_ms": 1e3 * statistics.mean(values["times"])}
        summary[name] = stats
        wait_median, wait_mean = (1e3 * f(values["waits"]) for f in (statistics.median, statistics.mean))
        length = statistics.mean(values["lengths"])
        pushes = values["push_waits"] or [float("nan")]
        print(f"{size:4s} {name:24s} pushes waited for the model: median {1e3 * statistics.median(pushes):7.1f} ms, "
              f"max {1e3 * max(pushes):7.1f} ms ({len(values['push_waits'])} pushes)")
        print(f"{size:4s} {name:24s} median {stats['median_ms']:8.1f} ms  mean {stats['mean_ms']:8.1f}  "
              f"p20 {stats['p20_ms']:8.1f}  p80 {stats['p80_ms']:8.1f}  waiting for rollouts: median "
              f"{wait_median:8.1f} mean {wait_mean:8.1f} ms  mean response {length:5.1f} tokens")
        rows.append({"benchmark": "async", "implementation": name, "device": "cpu",
                     "size": f"{label}, server core 0, trainer core 1", "threads": 1, **stats,
                     "rollout_wait_median_ms": wait_median, "rollout_wait_mean_ms": wait_mean,
                     "mean_response_tokens": length, "n": len(values["times"]), "load_avg_1min": load})
    for statistic in ("median_ms", "mean_ms"):
        async_ms = summary[ASYNC][statistic]
        print(f"{size:4s} step time ({statistic[:-3]}), async k=1 / server sync: "
              f"{async_ms / summary[SYNC][statistic]:.2f}, async k=1 / colocated hf: "
              f"{async_ms / summary[COLOCATED][statistic]:.2f}")
    per_token = {name: summary[name]["mean_ms"] / statistics.mean(values["lengths"])
                 for name, values in measured.items()}
    print(f"{size:4s} mean step time per mean response token, async k=1 / server sync: "
          f"{per_token[ASYNC] / per_token[SYNC]:.2f}, async k=1 / colocated hf: "
          f"{per_token[ASYNC] / per_token[COLOCATED]:.2f}")
    generation = statistics.mean(measured[SYNC]["waits"])
    training = statistics.mean(measured[SYNC]["times"]) - generation
    bound = max(generation, training) / (generation + training)
    print(f"{size:4s} sync server: generation {generation:.2f} s + the rest {training:.2f} s (means); "
          f"async can reach at best max(G, T) / (G + T) = {bound:.2f}")
    for name in (ASYNC, PARTIAL):
        ratio = summary[name]["mean_ms"] / summary[SYNC]["mean_ms"]
        print(f"{size:4s} {name}: mean step / sync {ratio:.2f} = {ratio / bound:.2f}x the ideal bound")
    return rows


def report_rewards(rewards: dict[int, dict[str, list[float]]], mixed: dict[str, float], correction: str,
                   load: str) -> list[dict]:
    """Prints the outcome-reward comparison (``correction``: the runs' rollout correction; ``mixed``: the share of
    rows holding two policy versions) and returns its CSV rows."""
    print(f"reward comparison, rollout correction {correction}: load average (1 min) {load}")
    print("rows mixing two policy versions (mean over steps and seeds): "
          + ", ".join(f"{name} {share:.3f}" for name, share in mixed.items()))
    steps = len(next(iter(rewards.values()))[SYNC])
    windows = {f"mean outcome reward, steps 1-{steps}": slice(None),
               f"mean outcome reward, steps {steps - steps // 3 + 1}-{steps}": slice(steps - steps // 3, None)}
    rows = []
    for metric, window in windows.items():
        means = {seed: {name: statistics.mean(values[window]) for name, values in by_name.items()}
                 for seed, by_name in rewards.items()}
        for seed, by_name in means.items():
            print(f"seed {seed}: {metric}: " + ", ".join(f"{name} {value:.4f}" for name, value in by_name.items()))
            for name, value in by_name.items():
                rows.append({"benchmark": "async_reward", "implementation": name, "device": "cpu",
                             "size": "tiny_adder 16x8x28", "threads": 1, "seeds": seed, "metric": metric,
                             "value": value, "n": steps, "rollout_correction": correction,
                             "mixed_rows": mixed[name], "load_avg_1min": load})
        spread = statistics.stdev(m[SYNC] for m in means.values()) if len(means) > 1 else float("nan")
        for name, label in ((ASYNC, "async - sync"), (PARTIAL, "async partial - sync")):
            differences = [by_name[name] - by_name[SYNC] for by_name in means.values()]
            error = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
            print(f"{metric}: {name} - {SYNC} {statistics.mean(differences):+.4f} ± {error:.4f} (paired over "
                  f"{len(differences)} seeds; the sync runs' standard deviation over seeds: {spread:.4f})")
            rows.append({"benchmark": "async_reward", "implementation": label, "device": "cpu",
                         "size": "tiny_adder 16x8x28", "threads": 1, "seeds": " ".join(map(str, rewards)),
                         "metric": metric, "value": statistics.mean(differences), "stderr": error, "n": steps,
                         "rollout_correction": correction, "load_avg_1min": load})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=("tiny", "mid"), default=["tiny", "mid"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round, tiny")
    parser.add_argument("--mid-steps", type=int, default=3, help="timed steps per variant and round, mid")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the four variants")
    parser.add_argument("--mid-prompts", type=int, default=4)
    parser.add_argument("--mid-new-tokens", type=int, default=256)
    parser.add_argument("--reward-seeds", type=int, nargs="*", default=[],
                        help="seeds of the outcome-reward comparison on tiny, sync server vs async k=1 without and "
                             "with partial rollouts (none: skipped)")
    parser.add_argument("--reward-steps", type=int, default=60)
    parser.add_argument("--reward-only", action="store_true",
                        help="skip the step times: only the outcome-reward comparison (needs --reward-seeds)")
    parser.add_argument("--reward-correction", choices=literal_values(CorrectionMode), default=None,
                        help="loss.rollout_correction.mode of both runs of the reward comparison (default: none)")
    parser.add_argument("--reward-correction-cap", type=float, default=None,
                        help="loss.rollout_correction.cap of --reward-correction (default the group's: 2, icepop 5)")
    parser.add_argument("--reward-slowed-server", type=int, default=0, metavar="LOOPS",
                        help="during the reward comparison, LOOPS busy processes share the server's core, so that "
                             "pushes land mid-generation and partial rollouts train on rows of two versions")
    parser.add_argument("--csv", default=None, help="CSV to append to (default benchmarks/results/results.csv)")
    args = parser.parse_args()
    if args.reward_slowed_server and not shutil.which("taskset"):
        parser.error("--reward-slowed-server needs taskset")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: a step's time is measured from the previous step's end")
    if args.reward_only and not args.reward_seeds:
        parser.error("--reward-only needs --reward-seeds")
    if args.reward_correction_cap is not None and args.reward_correction is None:
        parser.error("--reward-correction-cap needs --reward-correction")
    correction = RolloutCorrection(mode=args.reward_correction, cap=args.reward_correction_cap)
    try:
        correction.check("loss.rollout_correction")
    except ConfigError as err:
        parser.error(str(err))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the server, one for the trainer")
    load_start = os.getloadavg()[0]
    temporary = Path(tempfile.mkdtemp(prefix="bench_async_"))
    os.sched_setaffinity(0, {cores[1]})
    torch.set_num_threads(1)
    labels = {"tiny": "tiny_adder 16x8x28",
              "mid": f"random Qwen2 19M {args.mid_prompts}x8x{args.mid_new_tokens}"}
    rows = []
    try:
        for size in ["tiny"] if args.reward_only else args.sizes:
            policy = None
            if size == "mid":
                from bench_trl_race import build_mid_policy

                policy = temporary / "mid_policy"
                build_mid_policy(policy)
            settings = job(size, policy, args.mid_prompts, args.mid_new_tokens)
            process, url = start_server(temporary / f"server_{size}.log", str(policy or "bundled:tiny_adder"),
                                         core=cores[0])
            try:
                steps = args.steps if size == "tiny" else args.mid_steps
                if not args.reward_only:
                    measured = time_size(url, temporary / f"server_{size}.log", settings, steps, args.warmup,
                                         args.rounds)
                    rows += report_times(size, labels[size], measured, load_span(load_start))
                if size == "tiny" and args.reward_seeds:
                    with busy_core(cores[0], args.reward_slowed_server):
                        rewards, mixed = compare_rewards(url, settings, args.reward_seeds, args.reward_steps,
                                                         correction)
                    label = correction_label(correction) + (f", server slowed by {args.reward_slowed_server} busy "
                                                            "loops" if args.reward_slowed_server else "")
                    rows += report_rewards(rewards, mixed, label, load_span(load_start))
            finally:
                process.kill()
                process.wait(timeout=30)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    from common import append_csv, timestamp

    for row in rows:
        append_csv(args.csv, {"timestamp": timestamp(), **row})

if __name__ == "__main__":
    main()
