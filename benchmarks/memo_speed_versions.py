"""CPU step time of this checkout's memo executor against an earlier commit's, measured side by side in one run.

The contenders and the model are those of ``benchmarks/memo_speed.py`` (HF checkpointing, memo X+attn, memo X
only, memo alpha 0.5 on a small float32 Llama). Each version runs in a process of its own, its ``hf_memo``
imported from its tree (the earlier commit checked out in a temporary ``git worktree``); the processes build the
same models from the same seed and take turns: one timed step at a time, round-robin over every (version,
contender) pair, starting one pair later each round, so that machine noise hits both versions alike. The other
process waits on its pipe meanwhile. Reported per length: each pair's median step seconds, its ratio to HF
checkpointing in the same process, and this checkout's time over the earlier commit's for each contender (below 1:
faster now), with both versions' attention kernels per layer and their losses.

    python benchmarks/memo_speed_versions.py --before 6de472d   # before query-block attention (issue 33)
    python benchmarks/memo_speed_versions.py --before 6de472d --seq-lens 2048 4096 --repeats 5
    python benchmarks/memo_speed_versions.py --before HEAD --tiny --out /tmp/x   # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_out_option

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def serve(root: str, tiny: bool, seed: int) -> None:
    """The child: ``hf_memo`` from ``root``; reads one JSON command per line from stdin and answers one line."""
    sys.path[:0] = [root, str(HERE)]
    import gc

    import memo_speed
    import torch

    from common import tiny_llama

    if tiny:
        torch.set_num_threads(1)  # on a busy machine no thread waits on another process's core
    config = tiny_llama(2) if tiny else memo_speed.benchmark_config()
    models: dict = {}
    ids = None
    for line in sys.stdin:
        command = json.loads(line)
        if "build" in command:
            seq_len = command["build"]
            models.clear()
            gc.collect()
            ids = torch.randint(3, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed + 1))
            models = {name: memo_speed.build(config, make, seed) for name, make in memo_speed.CONTENDERS.items()}
            counted = {}
            for name, model in models.items():
                memo_speed.step(model, ids)  # warm-up
                counted[name] = memo_speed.counted_step(model, ids)
            answer = {"counted": counted, "hf_memo": sys.modules["hf_memo"].__file__}
        else:
            gc.collect()
            forward, backward, loss = memo_speed.step(models[command["step"]], ids)
            answer = {"forward_s": forward, "backward_s": backward, "loss": loss}
        print(json.dumps(answer), flush=True)


class Version:
    """A child process serving one tree's contenders."""

    def __init__(self, label: str, root: str, tiny: bool, seed: int) -> None:
        self.label = label
        argv = [sys.executable, __file__, "--serve", root, "--seed", str(seed), *(["--tiny"] if tiny else [])]
        env = {**os.environ, "PYTHONPATH": ""}
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} process ended (exit {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def measure_length(versions: list[Version], contenders: list[str], seq_len: int, repeats: int) -> dict:
    """Both versions at ``seq_len``: built and warmed up, then ``repeats`` interleaved rounds."""
    rows: dict[str, dict] = {}
    for version in versions:
        built = version.ask({"build": seq_len})
        for name in contenders:
            rows[f"{version.label} | {name}"] = {**built["counted"][name], "step_s": [], "losses": []}
        print(f"S={seq_len} {version.label}: built from {built['hf_memo']}", flush=True)
    pairs = [(version, name) for name in contenders for version in versions]
    for round_ in range(repeats):
        for version, name in pairs[round_ % len(pairs) :] + pairs[: round_ % len(pairs)]:
            timed = version.ask({"step": name})
            row = rows[f"{version.label} | {name}"]
            row["step_s"].append(timed["forward_s"] + timed["backward_s"])
            row["losses"].append(timed["loss"])
        print(f"S={seq_len}: round {round_ + 1}/{repeats} done", flush=True)
    for key, row in rows.items():
        label = key.split(" | ")[0]
        row["median_s"] = statistics.median(row["step_s"])
        row["ratio_to_hf_checkpointing"] = row["median_s"] / statistics.median(
            rows[f"{label} | {contenders[0]}"]["step_s"]
        )
    for name in contenders:
        now, before = (rows[f"{version.label} | {name}"] for version in versions)
        now["now_over_before"] = now["median_s"] / before["median_s"]
        now["max_abs_loss_diff_to_before"] = max(abs(a - b) for a, b in zip(now["losses"], before["losses"]))
    return rows


def table(results: dict) -> str:
    before = results["before"]
    lines = [
        f"Median of {results['repeats']} interleaved steps per (version, contender); {results['shape']}; forward + "
        "backward, no optimizer. Kernels: aten attention calls per layer, forward / backward.",
        "",
        f"| S | contender | now (s) | {before} (s) | now / {before} | now: kernels | {before}: kernels | "
        "now: / HF ckpt | before: / HF ckpt |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len, rows in results["lengths"].items():
        for name in results["contenders"]:
            now, old = rows[f"now | {name}"], rows[f"{before} | {name}"]
            lines.append(
                f"| {int(seq_len):,} | {name} | {now['median_s']:.3f} | {old['median_s']:.3f} | "
                f"{now['now_over_before']:.3f} | {now['forward_per_layer']:g} / {now['backward_per_layer']:g} | "
                f"{old['forward_per_layer']:g} / {old['backward_per_layer']:g} | "
                f"{now['ratio_to_hf_checkpointing']:.3f} | {old['ratio_to_hf_checkpointing']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the earlier commit to compare with (any git revision)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 2048 4096 8192")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per version, contender and length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--tiny", action="store_true", help="tiny model and lengths: a seconds-long smoke run")
    add_out_option(parser)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.tiny, args.seed)
        return
    if args.before is None:
        parser.error("--before REV is required")
    import memo_speed

    from common import results_folder, tiny_llama

    seq_lens = args.seq_lens or ([256, 512] if args.tiny else [2048, 4096, 8192])
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
    ).stdout.strip()
    contenders = list(memo_speed.CONTENDERS)
    with tempfile.TemporaryDirectory() as scratch:
        tree = str(Path(scratch) / commit)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tree, commit], check=True)
        versions = [Version("now", str(ROOT), args.tiny, args.seed), Version(commit, tree, args.tiny, args.seed)]
        try:
            lengths = {seq_len: measure_length(versions, contenders, seq_len, args.repeats) for seq_len in seq_lens}
        finally:
            for version in versions:
                version.close()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree], check=True)
    shape = memo_speed.describe(tiny_llama(2) if args.tiny else memo_speed.benchmark_config(), args.tiny)
    results = {"before": commit, "repeats": args.repeats, "shape": shape, "contenders": contenders, "lengths": lengths}
    _, folder = results_folder(args.out)
    (folder / "memo_speed_versions.json").write_text(json.dumps(results, indent=1) + "\n")
    (folder / "memo_speed_versions.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
