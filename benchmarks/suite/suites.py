"""Named suites: which workloads and contenders, at which lengths, under which time limits."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.suite.contenders import CONTENDERS, contender
from benchmarks.suite.search import length_grid
from benchmarks.suite.workloads import WORKLOADS, workload

DRY_RUN_SCALE = 512  # the dry run's sequence lengths are the real ones divided by this: 16K -> 32 tokens
K = 1024


@dataclass(frozen=True)
class Plan:
    """The concrete numbers of a suite for one kind of run (on the GPU, or the CPU dry run).

    Attributes:
        timed_lengths: lengths timed for every workload/contender pair (ascending; a failure stops them).
        grid: candidate lengths of the longest-sequence search.
        reference_length: the length at which MFU and throughput are compared.
        time_limit_s: seconds one configuration's process may take before it is killed (a timeout).
        min_launch_s: a configuration is not started with less budget left than this.
        max_timed_steps, min_measure_s: timed runs stop after this many steps or seconds.
    """

    dry_run: bool
    scale: int
    timed_lengths: tuple[int, ...]
    grid: list[int]
    reference_length: int
    time_limit_s: float
    min_launch_s: float
    max_timed_steps: int
    min_measure_s: float


@dataclass(frozen=True)
class Suite:
    """A named set of workloads x contenders with real (GPU) lengths; :meth:`plan` scales them for a dry run."""

    name: str
    description: str
    workloads: tuple[str, ...]
    contenders: tuple[str, ...]
    timed_lengths: tuple[int, ...] = (16 * K, 128 * K)
    grid_step: int = 16 * K
    grid_max: int = 1024 * K
    reference_length: int = 128 * K
    time_limit_s: float = 480.0
    min_launch_s: float = 90.0
    max_timed_steps: int = 3
    min_measure_s: float = 20.0

    def __post_init__(self) -> None:
        for name in self.workloads:
            workload(name)
        for name in self.contenders:
            contender(name)
        grid = length_grid(self.grid_step, self.grid_max)
        off_grid = [s for s in (*self.timed_lengths, self.reference_length) if s not in grid]
        if off_grid:
            raise ValueError(f"suite {self.name}: lengths {off_grid} are not on the {self.grid_step}-token grid")

    def plan(self, dry_run: bool) -> Plan:
        if not dry_run:
            return Plan(
                dry_run=False,
                scale=1,
                timed_lengths=tuple(sorted(self.timed_lengths)),
                grid=length_grid(self.grid_step, self.grid_max),
                reference_length=self.reference_length,
                time_limit_s=self.time_limit_s,
                min_launch_s=self.min_launch_s,
                max_timed_steps=self.max_timed_steps,
                min_measure_s=self.min_measure_s,
            )
        return Plan(
            dry_run=True,
            scale=DRY_RUN_SCALE,
            timed_lengths=tuple(sorted(s // DRY_RUN_SCALE for s in self.timed_lengths)),
            grid=length_grid(self.grid_step // DRY_RUN_SCALE, self.grid_max // DRY_RUN_SCALE),
            reference_length=self.reference_length // DRY_RUN_SCALE,
            time_limit_s=120.0,
            min_launch_s=10.0,
            max_timed_steps=2,
            min_measure_s=0.0,
        )


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            name="h200",
            description="Every workload and contender on one H200",
            workloads=tuple(WORKLOADS),
            contenders=tuple(CONTENDERS),
        ),
        Suite(
            name="acceptance",
            description="Llama-3-8B LoRA: the contenders the acceptance targets compare",
            workloads=("llama3-8b-lora",),
            contenders=("hf+ckpt", "hf+ckpt+offload", "minseq+ckpt", "memo-auto", "memo+planner"),
            timed_lengths=(128 * K,),
        ),
    )
}


def suite(name: str) -> Suite:
    """The suite called ``name``; ``ValueError`` lists the known ones."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    return SUITES[name]
