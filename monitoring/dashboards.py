"""The Grafana dashboards of resilient-rl, built with grafana-foundation-sdk.

``grafana/dashboards/*.json`` is this module's output: edit the panels here, never the JSON.

    python monitoring/dashboards.py --write    # regenerate grafana/dashboards/*.json
    python monitoring/dashboards.py --check    # exit 1 if a committed file differs

The SDK's typed builders (``grafana_foundation_sdk``, in the ``dev`` extra) are generated
from Grafana's dashboard schema: a misspelt option is an AttributeError here, not a key that
Grafana silently ignores, and the tests decode the committed JSON back through the same types. Every panel queries the provisioned Prometheus datasource
(``grafana/provisioning/datasources/prometheus.yml``, uid ``rrl-prometheus``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DASHBOARDS_DIR = Path(__file__).resolve().parent / "grafana" / "dashboards"
sys.path.append(str(Path(__file__).resolve().parent))  # dashboard_panels.py, beside this script
from dashboard_panels import (  # noqa: E402
    AGE_THRESHOLDS, GOODPUT_THRESHOLDS, GPU_LEGEND, PROCESS_LEGEND,
    RECOVERY_ANNOTATION, RUN, RUN_NODE, TORCH_LEGEND, WIDTH, WINDOW, build, increments, mean, quantile, run_growth,
    query_variable, row, run_variable, sel, stat_panel, ts_panel, window_variable)


# -- the four dashboards -------------------------------------------------------------------

def training() -> dict:
    """Step, rewards (training and validation), losses, KL, learning rate and throughput."""
    steps_per_min = f"sum(rate({sel('rrl_step_duration_seconds_count')}[{WINDOW}])) * 60"
    tokens = f"rate({sel('rrl_tokens_total')}[{WINDOW}])"
    return build("rrl-training", "resilient-rl / Training progress",
                 "Step, rewards, losses, KL, learning rate and throughput of a run.", [
        stat_panel("Step", f"max({sel('rrl_step')})", decimals=0),
        stat_panel("Steps / min", steps_per_min, decimals=2),
        stat_panel("Tokens / s", f"sum({tokens})"),
        stat_panel("Goodput", f"min({sel('rrl_goodput_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS),
        stat_panel("Last checkpoint step", f"max({sel('rrl_checkpoint_last_committed_step')})",
                   decimals=0),
        stat_panel("Checkpoint age", f"max({sel('rrl_checkpoint_age_seconds')})", "s",
                   thresholds=AGE_THRESHOLDS),
        ts_panel("Step", [(f"max by (instance) ({sel('rrl_step')})", "step {{instance}}"),
                          (f"max by (instance) ({sel('rrl_checkpoint_last_committed_step')})",
                           "last committed {{instance}}")],
                 description="Last completed step; it drops back after a restore and climbs again."),
        ts_panel("Reward (mean)", [(sel("rrl_reward_mean"), "{{instance}}")]),
        ts_panel("Validation (held-out prompts)", [(sel("rrl_val_reward_mean"), "reward {{instance}}"),
                                                   (sel("rrl_val_accuracy_ratio"), "accuracy {{instance}}")],
                 description="The last validation pass (trainer.test_freq): mean reward and the share of "
                             "responses scoring 1 on the held-out prompts."),
        ts_panel("Losses", [(sel("rrl_actor_loss"), "actor {{instance}}"),
                            (sel("rrl_critic_loss"), "critic {{instance}}")]),
        ts_panel("KL (actor vs reference)", [(sel("rrl_kl"), "{{instance}}")]),
        ts_panel("Learning rate", [(sel("rrl_learning_rate"), "{{role}} {{instance}}")], "sci"),
        ts_panel("Tokens / s", [(f"sum by (instance) ({tokens})", "{{instance}}")]),
        ts_panel("Goodput", [(sel("rrl_goodput_ratio"), "{{instance}}")], "percentunit",
                 min_val=0, max_val=1,
                 description="Share of wall time spent on steps that were kept."),
        ts_panel("Steps / min", [(f"sum by (instance) (rate({sel('rrl_step_duration_seconds_count')}"
                                  f"[{WINDOW}])) * 60", "{{instance}}")]),
    ], [run_variable(), window_variable()], [RECOVERY_ANNOTATION])


def throughput() -> dict:
    """Step time, its phases and tokens per second."""
    # The checkpoint phase is the save's stall after the step's timer stopped: not part of a step
    # (Reliability's checkpoint panels show it).
    in_step = sel("rrl_phase_duration_seconds_sum", RUN + ', phase!="checkpoint"')
    phase_rate = f"sum by (phase) (rate({in_step}[{WINDOW}]))"
    step_rate = "sum(rate({}[" + WINDOW + "]))"
    return build("rrl-throughput", "resilient-rl / Throughput and phases",
                 "Step time, its phases and tokens per second.", [
        ts_panel("Step duration", [
            (quantile(0.5, "rrl_step_duration_seconds", WINDOW), "p50"),
            (quantile(0.9, "rrl_step_duration_seconds", WINDOW), "p90"),
            (quantile(0.99, "rrl_step_duration_seconds", WINDOW), "p99"),
            (f"{step_rate.format(sel('rrl_step_duration_seconds_sum'))}"
             f" / {step_rate.format(sel('rrl_step_duration_seconds_count'))}", "mean")], "s"),
        ts_panel("Tokens / s", [(f"sum(rate({sel('rrl_tokens_total')}[{WINDOW}]))",
                                 "tokens/s")]),
        ts_panel("Mean time per step by phase", [(
            f"{phase_rate} / on () group_left () "
            f"{step_rate.format(sel('rrl_step_duration_seconds_count'))}", "{{phase}}")], "s",
            stacked=True,
            description="Seconds each phase adds to an average step (stacked: the step's make-up)."),
        ts_panel("Phase share of step time", [(
            f"{phase_rate} / on () group_left () "
            f"{step_rate.format(sel('rrl_step_duration_seconds_sum'))}", "{{phase}}")],
            "percentunit", min_val=0, stacked=True),
        ts_panel("Phase duration p95", [
            (quantile(0.95, "rrl_phase_duration_seconds", WINDOW, by="phase"),
             "{{phase}}")], "s"),
        ts_panel("Steps / min", [(
            f"{step_rate.format(sel('rrl_step_duration_seconds_count'))} * 60", "steps/min")]),
    ], [run_variable(), window_variable()], [RECOVERY_ANNOTATION])


def reliability() -> dict:
    """Workers, restarts, failures, recoveries, lost work and checkpoints."""
    count = dict(decimals=0)
    red_from_one = [("green", None), ("red", 1)]
    ckpt_save, ckpt_stall = "rrl_checkpoint_save_duration_seconds", "rrl_checkpoint_stall_seconds"
    ckpt_load, recovery = "rrl_checkpoint_load_duration_seconds", "rrl_recovery_duration_seconds"
    phases = "rrl_recovery_phase_seconds"
    # Failure to failed step done again, per recovery: every phase's time over the recoveries.
    restarts_counted = sel(phases + "_count", RUN + ', phase="restart"')
    mttr = f"sum(increase({sel(phases + '_sum')}[$__range])) / sum(increase({restarts_counted}[$__range]))"
    return build("rrl-reliability", "resilient-rl / Reliability",
                 "Workers, restarts, failures, recoveries, lost work and checkpoints.", [
        stat_panel("Workers up", f"sum({sel('rrl_worker_up')})", **count),
        stat_panel("Workers down", f"count({sel('rrl_worker_up')} == 0) or vector(0)",
                   thresholds=red_from_one, **count),
        stat_panel("Restarts (range)", increments("rrl_worker_restarts_total", "$__range"), **count),
        stat_panel("Recoveries (range)", increments("rrl_recoveries_total", "$__range"), **count),
        stat_panel("Steps replayed (range)", increments("rrl_steps_replayed_total", "$__range"),
                   **count),
        stat_panel("Corrupt checkpoints", f"sum({sel('rrl_checkpoint_corrupt_total')})",
                   thresholds=red_from_one, **count),
        stat_panel("Last checkpoint committed",
                   f"max({sel('rrl_checkpoint_last_committed_timestamp_seconds')}) * 1000",
                   "dateTimeFromNow", w=6),
        stat_panel("Last committed step", f"max({sel('rrl_checkpoint_last_committed_step')})",
                   w=6, **count),
        stat_panel("Checkpoint age", f"max({sel('rrl_checkpoint_age_seconds')})", "s",
                   thresholds=AGE_THRESHOLDS, w=6),
        stat_panel("Goodput", f"min({sel('rrl_goodput_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS, w=6),
        ts_panel("Workers up by role", [(f"sum by (role) ({sel('rrl_worker_up')})", "{{role}}")],
                 min_val=0,
                 description="Live workers per role; a dip is a failure, the climb back a recovery."),
        # 1 for each worker while it is down, nothing while it is up.
        ts_panel("Workers down", [(f"(1 - {sel('rrl_worker_up')}) > 0", PROCESS_LEGEND)],
                 min_val=0, description="One line at 1 per worker while it is down."),
        ts_panel("Restarts by cause", [(increments("rrl_worker_restarts_total", "$__interval",
                                                   by="cause"), "{{cause}}")], stacked=True),
        ts_panel("Restarts by worker", [(increments("rrl_worker_restarts_total", "$__interval",
                                                    by="role, rank"), "{{role}}/{{rank}}")],
                 stacked=True),
        ts_panel("Failures by cause", [(increments("rrl_failures_total", "$__interval",
                                                   by="cause"), "{{cause}}")], stacked=True),
        ts_panel("Recovery duration", [(quantile(0.5, recovery, "10m"), "p50 (10m)"),
                                       (quantile(0.95, recovery, "10m"), "p95 (10m)"),
                                       (mean(recovery, "10m"), "mean (10m)")], "s",
                 description="Failure detected to training resumed, over 10-minute windows."),
        ts_panel("Lost work", [(increments("rrl_steps_replayed_total", "$__interval"),
                                "steps replayed"),
                               (increments("rrl_recoveries_total", "$__interval"), "recoveries")]),
        ts_panel("Goodput", [(sel("rrl_goodput_ratio"), "{{instance}}")], "percentunit",
                 min_val=0, max_val=1),
        ts_panel("Checkpoint save and stall", [(quantile(0.95, ckpt_save, "10m"), "save p95"),
                                               (mean(ckpt_save, "10m"), "save mean"),
                                               (mean(ckpt_stall, "10m"), "stall mean"),
                                               (quantile(0.95, ckpt_stall, "10m"), "stall p95")],
                 "s", description="Save: start to commit (async). Stall: time training was blocked."),
        ts_panel("Checkpoint load duration", [(mean(ckpt_load, "10m"), "mean (10m)"),
                                              (quantile(0.95, ckpt_load, "10m"), "p95 (10m)")], "s"),
        ts_panel("Checkpoint write rate", [(f"sum(rate({sel('rrl_checkpoint_bytes_total')}"
                                            f"[{WINDOW}]))", "bytes/s")], "Bps"),
        ts_panel("Checkpoint age", [(sel("rrl_checkpoint_age_seconds"), "age {{instance}}")], "s",
                 description="Seconds since the last commit: the work a crash would lose now."),
        ts_panel("Steps since last checkpoint", [(
            f"{sel('rrl_step')} - {sel('rrl_checkpoint_last_committed_step')}", "{{instance}}")]),
        ts_panel("Corrupt checkpoints and snapshots",
                 [(increments("rrl_checkpoint_corrupt_total", "$__interval"), "checkpoint"),
                  (increments("rrl_snapshot_corrupt_total", "$__interval", by="source"),
                   "snapshot copy ({{source}})")],
                 description="Copies that failed verification and were not restored: a checkpoint "
                             "(the previous one was used) or an in-memory snapshot copy (the next "
                             "source was tried: peer copy, older snapshot, checkpoint)."),
        ts_panel("Skipped checkpoints", [(increments("rrl_checkpoint_skipped_total", "$__interval",
                                                     by="reason"), "{{reason}}")], stacked=True,
                 description="Saves skipped while training went on: storage (an outage past the "
                             "retries) or slow (the previous save still writing after "
                             "checkpoint.save_timeout_s). More than checkpoint.max_skipped in a row "
                             "stop the run."),
        row("Recovery by phase and effective training time"),
        stat_panel("ETTR (whole run)", f"min({sel('rrl_ettr_ratio')})", "percentunit",
                   thresholds=GOODPUT_THRESHOLDS, w=8,
                   description="Seconds of steps that count over wall seconds since the run began, "
                               "across controller restarts (ettr.json in the run folder)."),
        stat_panel("Lost time (range)", run_growth("rrl_lost_seconds_total", "$__range"), "s", w=8,
                   description="Failed work, recovery, rolled-back steps and a crashed controller's "
                               "pause, over the time range."),
        stat_panel("Mean time to recover (range)", mttr, "s", w=8,
                   description="Failure to the failed step done again (detect + restart + rejoin + "
                               "restore + replay), mean over the recoveries in the time range."),
        ts_panel("Recovery phases (mean, 10m)", [(mean(phases, "10m", by="phase"), "{{phase}}")], "s",
                 stacked=True, w=8,
                 description="detect: failure reported (or hang start) to recovery; restart: workers back; "
                             "rejoin: new process groups; restore: snapshot or checkpoint loaded; "
                             "replay: until the failed step is done again."),
        ts_panel("Lost time by cause", [(run_growth("rrl_lost_seconds_total", "$__interval", by="cause"),
                                         "{{cause}}")], "s", stacked=True, w=8),
        ts_panel("ETTR and goodput", [(sel("rrl_ettr_ratio"), "ETTR {{instance}}"),
                                      (sel("rrl_goodput_ratio"), "goodput {{instance}}")], "percentunit",
                 min_val=0, max_val=1, w=8,
                 description="ETTR spans the run's whole life; goodput this controller's. Both fall "
                             "while a step hangs."),
    ], [run_variable(), window_variable()], [RECOVERY_ANNOTATION])


#: GPUs a worker computes on (an unused GPU of a node has role="", and may idle on purpose).
ASSIGNED = ', role!=""'


def gpus() -> dict:
    """Per-GPU readings (NVML) by node and rank, torch memory per rank; CPU and memory of
    worker processes."""
    def gpu(metric: str) -> str:
        return sel(metric, RUN_NODE)
    cpu = f"rate({gpu('rrl_process_cpu_seconds_total')}[$__rate_interval])"
    node_variable = query_variable("node", "Node", "label_values(rrl_worker_up{run=~\"$run\"}, node)")
    return build("rrl-gpus", "resilient-rl / GPUs and processes",
                 "Per-GPU readings by node and rank (NVML); CPU and memory of worker processes.", [
        stat_panel("Mean GPU utilization", f"avg({sel('rrl_gpu_utilization_ratio', RUN_NODE + ASSIGNED)})",
                   "percentunit"),
        stat_panel("GPU memory used", f"sum({gpu('rrl_gpu_memory_used_bytes')})", "bytes"),
        stat_panel("GPU power", f"sum({gpu('rrl_gpu_power_watts')})", "watt"),
        stat_panel("Hottest GPU", f"max({gpu('rrl_gpu_temperature_celsius')})", "celsius",
                   thresholds=[("green", None), ("orange", 80), ("red", 88)]),
        stat_panel("Worker RSS", f"sum({gpu('rrl_process_resident_memory_bytes')})", "bytes"),
        stat_panel("Worker CPU", f"sum({cpu})",
                   description="CPU cores busy across worker processes."),
        ts_panel("GPU utilization", [(gpu("rrl_gpu_utilization_ratio"), GPU_LEGEND)],
                 "percentunit", min_val=0, max_val=1),
        ts_panel("GPU memory used", [(gpu("rrl_gpu_memory_used_bytes"), GPU_LEGEND)], "bytes",
                 min_val=0),
        ts_panel("Torch memory per rank", [
            (gpu("rrl_torch_memory_allocated_bytes"), f"allocated {TORCH_LEGEND}"),
            (gpu("rrl_torch_memory_reserved_bytes"), f"reserved {TORCH_LEGEND}")], "bytes",
            min_val=0, w=WIDTH,
            description="torch's view of each worker process's GPU memory: live tensors (allocated) "
                        "and what the caching allocator holds (reserved), as of the last health "
                        "reply. Absent on CPU."),
        ts_panel("GPU memory used / total", [(
            f"{gpu('rrl_gpu_memory_used_bytes')} / {gpu('rrl_gpu_memory_total_bytes')}",
            GPU_LEGEND)], "percentunit", min_val=0, max_val=1),
        ts_panel("GPU power", [(gpu("rrl_gpu_power_watts"), GPU_LEGEND)], "watt", min_val=0),
        ts_panel("GPU temperature", [(gpu("rrl_gpu_temperature_celsius"), GPU_LEGEND)], "celsius"),
        ts_panel("GPU SM clock", [(gpu("rrl_gpu_sm_clock_hertz"), GPU_LEGEND)], "hertz"),
        ts_panel("Worker CPU (cores)", [(cpu, PROCESS_LEGEND)]),
        ts_panel("Worker resident memory", [(gpu("rrl_process_resident_memory_bytes"),
                                             PROCESS_LEGEND)], "bytes"),
    ], [run_variable(), node_variable])


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON, for every dashboard this project ships."""
    boards = [training(), throughput(), reliability(), gpus()]
    return {f"{board['uid']}.json": board for board in boards}


def render(board: dict) -> str:
    """The committed text of a dashboard: stable key order, two-space indent, final newline."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write grafana/dashboards/*.json")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if a committed dashboard differs from the generated one")
    args = parser.parse_args(argv)
    boards = {name: render(board) for name, board in dashboards().items()}
    committed = {p.name for p in DASHBOARDS_DIR.glob("*.json")}
    if args.write:
        for name, text in boards.items():
            (DASHBOARDS_DIR / name).write_text(text)
        for name in committed - set(boards):
            (DASHBOARDS_DIR / name).unlink()
        print(f"wrote {len(boards)} dashboards to {DASHBOARDS_DIR}")
        return 0
    def differs(name: str, text: str) -> bool:
        path = DASHBOARDS_DIR / name
        return not path.exists() or path.read_text() != text
    stale = sorted(name for name, text in boards.items() if differs(name, text))
    stale += sorted(committed - set(boards))
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {Path(__file__).name} --write",
              file=sys.stderr)
        return 1
    print(f"{len(boards)} dashboards up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
