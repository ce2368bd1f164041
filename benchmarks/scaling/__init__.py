"""Shared machinery of the workload scaling benchmarks (ViT, Transolver, StormScope).

A workload CLI (benchmarks/<name>/bench.py) only says how to build its model, make a synthetic input of a given
size, shard it and compute a loss (a ``Workload`` subclass); ``runner.main(workload)`` does the rest: launching
ranks (torchrun or self-spawned Gloo), the correctness check against one device, timing, per-rank memory and
communication, strong/weak scaling sweeps, the 2-D (data x domain) mesh with DDP or FSDP2, JSON/Markdown/PNG.

    workload.py the interface a CLI implements
    runner.py   the CLI: the plan of cases, launching, the result files
    launch.py   process groups: torchrun or self-spawned ranks, device and backend choice
    parallel.py meshes, and DDP / FSDP2 on the data axis of a 2-D mesh
    data.py     this rank's shard of the synthetic input
    check.py    the correctness check against one device (before any timing)
    measure.py  timing, memory and communication of one case
    timing.py   warm-up + synchronised iterations, max over ranks per iteration
    memory.py   per-rank allocator peak, live state, collectives, gathering over ranks
    trace.py    forward collectives attributed to modules
    report.py   derived figures and the Markdown report
    plots.py    speed-up/efficiency, weak scaling, latency vs size, memory and communication per rank
"""
